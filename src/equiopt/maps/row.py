"""The row-norm maps (paper section 3.3): every row scaled by a function of its norm,
``Diag(eta(||D_i:||)) D`` (:func:`row_norm`, :func:`row_norm_factored`), with the row-scaling
rules of :func:`eta_scale`; centred, the horizontal form of LM heads and routers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..linalg.device_choices import decides_like
from .base import (
    Factored,
    RowReducer,
    _check,
    _compiling,
    _compute_dtype,
    _maybe_center,
    _renamed_keyword,
    _take,
    materialize,
)

EtaRule = str | Callable[[torch.Tensor], torch.Tensor]
ETA_RULES = ("inverse", "normalize", "rms")


def eta_scale(norms: torch.Tensor, eta: EtaRule = "inverse", eps: float = 1e-8, n: int = 1) -> torch.Tensor:
    """Row-scaling factors ``eta(||D_i:||)`` for row norms ``norms`` (any shape).

    ``"inverse"``: ``1 / (t + eps)``, the paper's smoothed normalisation (its default).
    ``"normalize"``: ``1 / t``, and ``0`` for a zero row (the fully normalised rule).
    ``"rms"``: ``sqrt(n) / (t + eps)``, rows of unit RMS instead of unit norm.
    A callable is applied to the norms as is. All are LPRO-compatible: any function of
    the row norm commutes with row permutations and right rotations.

    Args:
        norms: row norms ``||D_i:||``, any shape.
        eta: ``"inverse"``, ``"normalize"``, ``"rms"`` or a callable of the norms.
        eps: the smoothing added to the norms by ``"inverse"`` and ``"rms"``.
        n: the row length (columns of ``D``), used by ``"rms"``.

    Returns:
        The factors, of ``norms``' shape.
    """
    if callable(eta):
        return eta(norms)
    if eta == "inverse":
        return 1.0 / (norms + eps)
    if eta == "normalize":
        return torch.where(norms > 0, 1.0 / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.zeros_like(norms))
    if eta == "rms":
        return (n**0.5) / (norms + eps)
    raise ValueError(f"unknown row-scaling rule eta={eta!r}; valid: {', '.join(ETA_RULES)} or a callable")


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    """``||x_i:||`` as a column ``(..., m, 1)``.

    Under ``torch.compile`` on a CPU the squared norms go through a matrix-vector product:
    Inductor's C++ backend (torch 2.13) fails to generate the fused kernel of an in-place
    momentum update, a row reduction of it and a row-scaled write (``KeyError`` in its
    outer-loop fusion); the product keeps the reduction out of that fusion.
    """
    if decides_like(x) == "cpu" and _compiling():
        ones = torch.ones(x.shape[-1], 1, dtype=x.dtype, device=x.device)
        return ((x * x) @ ones).sqrt()
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def _row_factors(
    x: torch.Tensor,
    eta: EtaRule,
    eps: float,
    centered: bool,
    reducer: RowReducer | None = None,
    col_reducer: RowReducer | None = None,
    norms: torch.Tensor | None = None,
) -> Factored:
    """``Pi Diag(eta(||x_i:||)) x`` for an ``x`` that is already centred when ``centered``
    (``norms``: the row norms, where they are known).

    The final projection subtracts the column means ``s^T x / m`` of the scaled rows,
    computed as one vector-matrix product instead of a second pass over the matrix.
    ``col_reducer``: ``x`` holds some of the columns (a split of the work columns); the
    squared row norms, one per row, are completed by it (its ``count`` is the column count).
    """
    if norms is not None:
        n = x.shape[-1]
    elif col_reducer is None:
        norms, n = _row_norms(x), x.shape[-1]
    else:
        norms, n = col_reducer.sum(x.square().sum(dim=-1, keepdim=True)).sqrt(), col_reducer.count
    # A non-finite row norm (an overflowing or non-finite row) makes its scale NaN, not 0,
    # so the update's finite check sees it.
    s = eta_scale(norms, eta, eps, n) + (norms - norms)  # + 0, or NaN where the norm is Inf or NaN
    shift = None
    if centered:
        shift = (
            (s.mT @ x) / x.shape[-2]
            if reducer is None
            else reducer.sum(_take(reducer, s).mT @ _take(reducer, x)) / reducer.count
        )
    return Factored(x, row=s, shift=shift)


def row_norm(D: torch.Tensor, eps: float = 1e-8, center: bool = False, eta: EtaRule = "inverse") -> torch.Tensor:
    """Row-norm map ``Diag(eta(||D_i:||)) D`` (paper eq. of ``U_row``).

    With ``center=True``: ``Pi Diag(eta(||D_c,i:||)) D_c`` with ``D_c = Pi D`` (the
    final projection is essential: row-dependent scaling breaks zero column means).
    Zero rows (tokens never seen, experts never routed) give zero rows.

    Args:
        D: work matrices ``(..., m, n)``; rows are the symmetry axis.
        eps: the smoothing of the row norms (see :func:`eta_scale`).
        center: the horizontal (quotient) form for LM heads and routers.
        eta: the row-scaling rule, see :func:`eta_scale`.

    Returns:
        The update, of ``D``'s shape and dtype.
    """
    _check(D, "row_norm")
    return materialize(row_norm_factored(D, eps, center, eta)).to(D.dtype)


@_renamed_keyword("centred_input", "centered_input")
def row_norm_factored(
    D: torch.Tensor,
    eps: float = 1e-8,
    center: bool = False,
    eta: EtaRule = "inverse",
    reducer: RowReducer | None = None,
    centered_input: bool = False,
    col_reducer: RowReducer | None = None,
    row_sq: torch.Tensor | None = None,
) -> Factored:
    """:func:`row_norm` in factored form, in the compute dtype (float32 or float64).

    ``reducer``: the :class:`RowReducer` of a row-sharded ``D`` (None: ``D`` is whole).
    ``col_reducer``: the same for a ``D`` split by columns (sums over the columns of each
    row, completing the row norms). ``centered_input`` (with ``center``): ``D`` already has
    zero column means, so it is not centred again (no full-size copy); the output
    projection is kept.

    Args:
        D: work matrices ``(..., m, n)`` (this rank's rows or columns when split).
        eps: the smoothing of the row norms.
        center: the horizontal (quotient) form.
        eta: the row-scaling rule, see :func:`eta_scale`.
        reducer: completes sums over rows split across ranks; None for a whole ``D``.
        centered_input: ``D`` already has zero column means. The former spelling
            ``centred_input=`` is a deprecated alias (it warns); passing both raises
            :class:`TypeError`.
        col_reducer: completes the row norms of a ``D`` split by columns.
        row_sq: the sums of squares of ``D``'s rows, ``(..., m, 1)``, where they are known
            already (whole rows of ``D`` as the map reads it: uncentred, or with
            ``centered_input``): the norms are their square roots.

    Returns:
        The update as a :class:`Factored`.
    """
    if row_sq is not None and (
        (center and not centered_input) or col_reducer is not None or row_sq.shape != (*D.shape[:-1], 1)
    ):
        raise ValueError(
            f"row_sq: the sums of squares of whole rows of D as the map reads it (uncentred, or centred "
            f"already), shape {(*D.shape[:-1], 1)}; got {tuple(row_sq.shape)}"
            + (" with center=True on an input not centred" if center and not centered_input else "")
        )
    x = _maybe_center(D.to(_compute_dtype(D)), center, reducer, centered_input)
    norms = None if row_sq is None else row_sq.to(x.dtype).sqrt()
    return _row_factors(x, eta, eps, center, reducer, col_reducer, norms)
