"""The two-sided polar maps: Muon's orthogonal polar factor ``U V^T`` (:func:`spectral`,
group ``O(m) x O(n)``) and its row-normalised forms, Muon+ / MuonEq-style
(:func:`spectral_row`, :func:`spectral_row_factored`) and NorMuon's row stage with its
second moments (:func:`normuon_rows`, :func:`normuon_moments_`), group ``Perm(m) x O(n)``."""

from __future__ import annotations

import torch

from ..linalg import polar
from .base import Factored, RowReducer, _check, _compute_dtype, _take, materialize


def spectral(
    D: torch.Tensor,
    method: str = "polar_express",
    steps: int = 5,
    dtype: torch.dtype | None = None,
    reducer: RowReducer | None = None,
    narrow: bool = False,
    sq_norm: torch.Tensor | None = None,
    finite: torch.Tensor | None = None,
) -> torch.Tensor:
    """Orthogonal polar factor ``U V^T`` of ``D`` (Muon / PolarGrad; bi-orthogonally equivariant).

    ``dtype`` is the iteration's precision (see :func:`equiopt.linalg.polar`).

    Args:
        D: work matrices ``(..., m, n)``.
        method: the polar method (:data:`equiopt.linalg.POLAR_METHODS`).
        steps: iterations.
        dtype: the iteration's precision; None for the method's default.
        reducer: the :class:`RowReducer` of a tall ``D`` split by rows (``D`` is this rank's
            rows; ``method="gram_newton_schulz"`` only: the ``n x n`` Grams are summed).
        narrow: keep the iteration's dtype where it is narrower than ``D``'s (see
            :func:`equiopt.linalg.polar`).
        sq_norm: each matrix's squared Frobenius norm, ``(..., 1, 1)``, where it is known.
        finite: ``(N,)`` bool, set to whether each factor is free of NaN and Inf (see
            :func:`equiopt.linalg.polar`).

    Returns:
        The polar factor, of ``D``'s shape and dtype (unless ``narrow``).
    """
    _check(D, "spectral")
    return polar(
        D, method=method, steps=steps, dtype=dtype, reducer=reducer, narrow=narrow, sq_norm=sq_norm, finite=finite
    )


def _frobenius_rescale(o_sq: torch.Tensor, d: torch.Tensor, reducer: RowReducer | None) -> torch.Tensor:
    """Row factors ``d * ||O||_F / ||Diag(d) O||_F`` from the squared row norms ``o_sq``
    (``(..., m, 1)``) of ``O`` and the row scales ``d``: the row-normalised update keeps the
    polar factor's Frobenius norm (NorMuon's rescaling). A symmetric function of the rows."""

    def rows_total(t: torch.Tensor) -> torch.Tensor:
        if reducer is None:
            return t.sum(dim=-2, keepdim=True)
        return reducer.sum(_take(reducer, t).sum(dim=-2, keepdim=True))

    total = rows_total(o_sq)
    scaled = rows_total(d.square() * o_sq)
    return d * (total / scaled.clamp_min(torch.finfo(scaled.dtype).tiny)).sqrt()


def spectral_row_factored(
    D: torch.Tensor,
    method: str = "polar_express",
    steps: int = 5,
    dtype: torch.dtype | None = None,
    eps: float = 1e-8,
    reducer: RowReducer | None = None,
) -> Factored:
    """The polar factor followed by row normalisation (Muon+ / MuonEq-style), in factored form.

    ``O = polar(D)``; ``U = c Diag(1 / (||O_i:|| + eps)) O`` with the scalar
    ``c = ||O||_F / ||Diag(1 / (||O_i:|| + eps)) O||_F``, so ``U`` has the polar factor's
    Frobenius norm (every row of ``U`` has the same norm). Symmetry group: row permutations
    times right orthogonal maps, ``Perm(m) x O(n)``: the row scaling is a function of the row
    norms, which commutes with row permutations and is invariant under right rotations,
    but not with left rotations (the polar factor alone keeps ``O(m) x O(n)``).

    Args:
        D: work matrices ``(..., m, n)``.
        method: the polar method (:data:`equiopt.linalg.POLAR_METHODS`).
        steps: iterations.
        dtype: the iteration's precision; None for the method's default.
        eps: the smoothing of the polar factor's row norms.
        reducer: the :class:`RowReducer` of a tall ``D`` split by rows (with
            ``method="gram_newton_schulz"``, as :func:`spectral`); the Frobenius norms are
            summed across the shards.

    Returns:
        The update as a :class:`Factored` (``x`` the polar factor, ``row`` its row factors).
    """
    o = polar(D, method=method, steps=steps, dtype=dtype, reducer=reducer).to(_compute_dtype(D))
    o_sq = o.square().sum(dim=-1, keepdim=True)
    d = 1.0 / (o_sq.sqrt() + eps)
    return Factored(o, row=_frobenius_rescale(o_sq, d, reducer))


def spectral_row(
    D: torch.Tensor, method: str = "polar_express", steps: int = 5, dtype: torch.dtype | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """:func:`spectral_row_factored` as one tensor of ``D``'s dtype (group ``Perm(m) x O(n)``)."""
    _check(D, "spectral_row")
    return materialize(spectral_row_factored(D, method, steps, dtype, eps)).to(D.dtype)


def normuon_rows(o: torch.Tensor, second: torch.Tensor, weight: torch.Tensor, eps: float = 1e-8) -> Factored:
    """NorMuon's row stage on polar factors ``o`` (``(N, m, n)``), updating its state in place.

    ``v_i <- v_i + w (mean_j O_ij^2 - v_i)`` (``w = 1 - beta2``; 0 for a skipped matrix,
    which leaves ``v`` as it was), then ``U = c Diag(1 / (sqrt(v_i) + eps)) O`` with
    ``c = ||O||_F / ||Diag(1 / (sqrt(v_i) + eps)) O||_F`` (the update keeps the polar
    factor's Frobenius norm; the EMA's start-up bias is a common factor of the rows and
    cancels in ``c``). Symmetry group ``Perm(m) x O(n)``: the state is indexed by rows and
    permuted with them; the row statistics are invariant under right rotations.

    Args:
        o: polar factors ``(N, m, n)``.
        second: the rows' second moments ``(N, m, 1)``, updated in place.
        weight: the EMA weight per matrix, ``(N, 1, 1)`` (or a scalar).
        eps: added to ``sqrt(v_i)``.

    Returns:
        The update as a :class:`Factored` (``x = o``, ``row`` the row factors).
    """
    o_sq = o.square().sum(dim=-1, keepdim=True)
    d = normuon_moments_(o_sq / o.shape[-1], second, weight, eps, o.dtype)
    return Factored(o, row=_frobenius_rescale(o_sq, d, None))


def normuon_moments_(
    mean_sq: torch.Tensor, second: torch.Tensor, weight, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """NorMuon's moment update ``v <- v + w (mean_sq - v)`` in place (a non-finite mean
    square counts as 0) and the row scales ``1 / (sqrt(v) + eps)`` in ``dtype``; the part
    of :func:`normuon_rows` that a row stage on sharded blocks shares."""
    mean_sq = torch.nan_to_num(mean_sq, nan=0.0, posinf=0.0, neginf=0.0)
    second.lerp_(mean_sq.to(second.dtype), weight.to(second.dtype) if torch.is_tensor(weight) else weight)
    return 1.0 / (second.to(dtype).sqrt() + eps)
