"""What every family of maps shares: the factored form of an update (:class:`Factored`,
:func:`materialize`), the row reducer of a split work matrix (:class:`RowReducer`) and its
sums, the centring projector (:func:`center`), and the checks and helpers of the maps'
entry points."""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple, Protocol

import torch

from ..linalg.products import mm, split_times
from .precision import _is_split, low_times


def _compute_dtype(D: torch.Tensor) -> torch.dtype:
    return D.dtype if D.dtype in (torch.float32, torch.float64) else torch.float32


def _check(D: torch.Tensor, name: str) -> None:
    if D.ndim < 2:
        raise ValueError(f"{name} expects work matrices of shape (..., m, n), got shape {tuple(D.shape)}")


class RowReducer(Protocol):
    """The one cross-shard operation of the maps: a sum over the row (symmetry) axis.

    When a work matrix is split by rows across ranks (FSDP2's ``Shard(0)`` of a
    vocabulary, SwiGLU or expert matrix), every reduction the maps take over rows (the
    column means of the centring, the centred-row shift ``s^T x / m``, the right Gram
    ``x^T x``, the shift ``mean(x) R`` and the soft row count of the ``"rms"`` scale)
    is a partial sum on each shard. ``sum(t)`` completes it (an all-reduce over the
    shard group; it may work in place on ``t``, always a fresh tensor) and ``count`` is
    the global row count. With ``reducer=None`` the maps take the matrix as whole.

    A reducer may also have ``take(t, dim)``: the rows (along ``dim``) this rank adds to
    the sums. Replicas that all hold the whole matrix (DDP, HSDP's replica axis) divide a
    Gram this way: each sums its own slice of the rows, the sum completes it, and every
    replica finishes the map on all rows, so no update is sent.

    And ``sum_then(t, fn, *extras)``: ``fn`` of the completed sums ``t`` of a batch of
    Grams, where ``fn`` maps each matrix on its own (the inverse square root and the scale
    of the one-sided maps) and ``extras`` are per-matrix tensors it reads alongside. A
    reducer may divide that work among its ranks (reduce-scatter the batch, ``fn`` on this
    rank's share, all-gather the results); without the method it is ``fn(sum(t), *extras)``.
    """

    count: int

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Complete a partial sum over the rows.

        Args:
            t: this rank's partial sums (a fresh tensor, which may be reduced in place).

        Returns:
            The sums over all the rows of the split matrix.
        """
        ...


def _take(reducer: RowReducer | None, t: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """The rows of ``t`` that ``reducer``'s sums take from this rank (all, unless it divides them)."""
    take = getattr(reducer, "take", None)
    return t if take is None else take(t, dim)


def _col_mean(x: torch.Tensor, reducer: RowReducer | None) -> torch.Tensor:
    """Column means over the rows, ``(..., 1, n)``: local, or completed by ``reducer``."""
    if reducer is None:
        return x.mean(dim=-2, keepdim=True)
    return reducer.sum(_take(reducer, x).sum(dim=-2, keepdim=True)) / reducer.count


def _sum_then(reducer: RowReducer | None, t: torch.Tensor, fn, *extras):
    """``fn(t, *extras)`` with ``t`` completed by ``reducer`` (which may divide ``fn``'s
    per-matrix work among its ranks, see :class:`RowReducer`)."""
    if reducer is None:
        return fn(t, *extras)
    divided = getattr(reducer, "sum_then", None)
    return fn(reducer.sum(t), *extras) if divided is None else divided(t, fn, *extras)


def _row_sum(t: torch.Tensor, reducer: RowReducer | None) -> torch.Tensor:
    """``t.sum(-1)`` of per-row values ``t`` (``(..., m)``), completed by ``reducer``."""
    return t.sum(-1) if reducer is None else reducer.sum(_take(reducer, t, -1).sum(-1))


class Factored(NamedTuple):
    """An update in factored form: ``U = row * (left @ x @ right) - shift``.

    ``x`` has shape ``(..., m, n)``; ``row`` ``(..., m, 1)``, ``left`` ``(..., m, m)``,
    ``right`` ``(..., n, n)`` and ``shift`` ``(..., 1, n)`` are optional; ``left`` and
    ``right`` are never both set, and ``row`` comes alone or with ``right`` (the hybrid's
    row-normalised stage left unformed, see :func:`hybrid_factored`). ``low``, when set,
    is ``x`` in the precision of the product with ``left`` or ``right``: rounded to
    bfloat16 (``gram_dtype="bfloat16"``, float32 accumulation, see :func:`low_product`),
    or its three bfloat16 parts side by side, ``(..., m, 3 n)`` (``"bfloat16x6"``, a
    float32-accurate product, see :mod:`equiopt.linalg.products`).
    """

    x: torch.Tensor
    row: torch.Tensor | None = None
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    low: torch.Tensor | None = None


def materialize(f: Factored) -> torch.Tensor:
    """The update ``U`` a :class:`Factored` stands for, as one tensor.

    Args:
        f: the update in factored form.

    Returns:
        ``U = row * (left @ x @ right) - shift``, of ``x``'s shape.
    """
    if f.row is not None and f.right is not None:
        u = mm(f.x, f.right).mul_(f.row)
        return u if f.shift is None else u.sub_(f.shift)
    if f.row is not None:
        if f.shift is not None:
            return torch.addcmul(-f.shift, f.x, f.row)
        return f.x * f.row
    if f.right is not None or f.left is not None:
        right = f.right is not None
        factor = f.right if right else f.left
        assert factor is not None
        if f.low is None:
            u = mm(f.x, factor) if right else mm(factor, f.x)
        else:
            times = split_times if _is_split(f.low, f.x) else low_times
            u = times(f.low, factor, right=right)
    else:
        return f.x if f.shift is None else f.x - f.shift
    u = u.to(f.x.dtype)
    return u if f.shift is None else u.sub_(f.shift)


def center(D: torch.Tensor) -> torch.Tensor:
    """``Pi D``: remove each column's mean over the rows (the shared-row direction ``1 a^T``).

    Args:
        D: work matrices ``(..., m, n)``.

    Returns:
        ``D`` minus its column means, a new tensor of the same shape.
    """
    _check(D, "center")
    return D - D.mean(dim=-2, keepdim=True)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def _maybe_center(
    D: torch.Tensor, flag: bool, reducer: RowReducer | None = None, centered_input: bool = False
) -> torch.Tensor:
    """``Pi D`` when ``flag`` (a new tensor), else ``D``; ``centered_input``: ``D`` is already
    ``Pi D`` (its owner centred it in place), so it is used as it is."""
    return D - _col_mean(D, reducer) if flag and not centered_input else D


def _renamed_keyword(old: str, new: str):
    """Accept the keyword ``old`` as a deprecated spelling of ``new``.

    ``old=`` still works and emits a :class:`DeprecationWarning` naming ``new``; passing
    both raises :class:`TypeError`. Calls that use ``new`` go straight through.
    """

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(
                        f"{fn.__name__}() got both {new!r} and its deprecated spelling {old!r}; pass only {new!r}"
                    )
                warnings.warn(
                    f"{fn.__name__}(): the keyword {old!r} is deprecated, use {new!r}", DeprecationWarning, stacklevel=2
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return inner

    return wrap


def gemm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``out += a @ b`` in place for 2-D or 3-D operands; False if the shapes don't allow it."""
    if out.ndim == 2 and a.ndim == 2 and b.ndim == 2:
        out.addmm_(a, b)
        return True
    if out.ndim == 3 and a.ndim == 3 and b.ndim == 3:
        out.baddbmm_(a, b)
        return True
    return False
