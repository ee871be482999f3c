"""The hybrid row-norm / one-sided spectral maps (Algorithm 2, HybridPolarGradM) in their
three orders (:data:`HYBRID_ORDERS`): :func:`hybrid` and :func:`hybrid_factored`, whose
row-normalised first stage before a right Gram is taken a block of rows at a time and never
formed (:func:`row_blocks`, :func:`row_scaled_blocks`, :func:`unformed_stage`)."""

from __future__ import annotations

import math

import torch

from ..linalg.device_choices import decides_like
from .base import (
    Factored,
    RowReducer,
    _check,
    _compiling,
    _renamed_keyword,
    _row_sum,
    _take,
    gemm_,
    materialize,
)
from .one_sided import _check_settings, _one_sided, _one_sided_input, _small_factor, gram_side
from .precision import gram_precision
from .row import EtaRule, _row_factors, _row_norms

HYBRID_ORDERS = ("row_then_right", "right_then_row", "left_then_row")


def hybrid(
    D: torch.Tensor,
    order: str = "row_then_right",
    eps: float = 1e-8,
    alpha: float = 1.0,
    center: bool = False,
    method: str = "polar_express",
    steps: int = 5,
    eta: EtaRule = "inverse",
    gram: str = "auto",
    scale: str = "nu",
    damping: str = "relative",
    gram_dtype: str | None = None,
    route: str = "gram",
) -> torch.Tensor:
    """Hybrid row-norm / one-sided spectral maps (Algorithm 2, HybridPolarGradM).

    ``"row_then_right"``: ``Z = Pi eta(D) D``, ``U = Pi nu^alpha Z (Z^T Z + eps I)^(-1/2)``.
    ``"right_then_row"``: ``Z = Pi nu^alpha D (D^T D + eps I)^(-1/2)``, ``U = Pi eta(Z) Z``.
    ``"left_then_row"`` (routers): ``Z = Pi nu^alpha (D D^T + eps I)^(-1/2) D``, ``U = Pi eta(Z) Z``.
    ``Pi`` is the centring projector when ``center=True`` (applied to the input too) and
    the identity otherwise. ``"right_then_row"`` and ``"left_then_row"`` differ only in the
    Gram matrix the literal algorithm forms (the maps agree); ``gram`` chooses it, and by
    default the smaller one is used.

    ``scale="rms"`` (scale-transferable, see :func:`_scale`): in ``"row_then_right"`` the
    one-sided stage uses ``rho^alpha sqrt(k n / r)``, ``r = min(k, n)``, instead of
    ``nu^alpha``, where ``k = (sum_i s_i)^2 / sum_i s_i^2`` with ``s_i = ||Z_i:||^2`` counts
    the rows the row-norm stage left nonzero (``k = m`` when every row has the same norm;
    the number of tokens seen, not the vocabulary, for an embedding's sparse gradient); in
    the two ``*_then_row`` orders, whose last stage fixes every row's norm to about 1
    whatever the first stage's scale, the result is multiplied by ``sqrt(n)``. Either way
    the nonzero rows of a step along a well-conditioned direction have RMS about 1, for
    every width and vocabulary. ``k`` is a symmetric function of the row norms, so the map
    stays left-permutation and right-orthogonal equivariant.

    Args:
        D: work matrices ``(..., m, n)``.
        order: ``"row_then_right"``, ``"right_then_row"`` or ``"left_then_row"``.
        eps: the damping of the one-sided stage and the smoothing of the row norms.
        alpha: the exponent of ``nu`` (the paper's HybridPolarGradM: 1).
        center: centre the input and project each stage (LM heads, routers).
        method: the inverse-square-root method (:data:`equiopt.linalg.INV_SQRT_METHODS`).
        steps: iterations of the inverse square root.
        eta: the row-scaling rule of the row-norm stage, see :func:`eta_scale`.
        gram: ``"auto"``, ``"right"`` or ``"left"``: the Gram matrix formed.
        scale: ``"nu"`` or ``"rms"``.
        damping: ``"relative"`` (default) or ``"absolute"``.
        gram_dtype: the precision of the one-sided stage's products, as in
            :func:`right_spectral`.
        route: the one-sided stage's route, as in :func:`right_spectral`.

    Returns:
        The update, of ``D``'s shape and dtype.
    """
    _check(D, "hybrid")
    f = hybrid_factored(
        D,
        order,
        eps,
        alpha,
        center,
        method,
        steps,
        eta,
        gram,
        scale,
        damping=damping,
        gram_dtype=gram_dtype,
        route=route,
    )
    return materialize(f).to(D.dtype)


def _clean_stage(f: Factored) -> Factored:
    """``f`` with the NaN and Inf entries of its materialised first stage ``f.x`` zeroed in place.

    The second stage's factors were formed from ``f.x`` as it was, so they carry any
    non-finite value (the optimizer's finite check reads them); the cleaned ``f.x`` keeps
    ``0 * NaN`` out of the product when such an update is skipped. With a low-precision
    copy (``gram_dtype``) the product reads the copy alone, and the optimizer cleans that
    (``optim.apply``), so ``f.x`` is left as it is: one full pass less.
    """
    if f.low is None:
        torch.nan_to_num_(f.x, nan=0.0, posinf=0.0, neginf=0.0)
    return f


# Rows per block of the unformed first stage: blocks of about this many bytes (on a CPU a
# block stays in cache and its memory is reused, where a fresh full-size Z costs its size
# in page faults every step); other devices take the matrix as one block.
STAGE_BLOCK_BYTES = {"cpu": 4 * 2**20}


def row_blocks(x: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` of ``x`` (``(..., m, n)``) in which an unformed first stage
    (:func:`hybrid_factored`) is taken: blocks of about :data:`STAGE_BLOCK_BYTES`."""
    m = x.shape[-2]
    budget = STAGE_BLOCK_BYTES.get(decides_like(x))
    if budget is None or m == 0:
        return [(0, m)]
    per_row = max(1, x.numel() // m) * x.element_size()
    step = max(1, budget // per_row)
    return [(a, min(a + step, m)) for a in range(0, m, step)]


def row_scaled_blocks(x: torch.Tensor, row: torch.Tensor):
    """Yield ``(a, b, z)`` for each block ``[a, b)`` of :func:`row_blocks` of ``x``, with
    ``z = row[..., a:b, :] * x[..., a:b, :]`` written into one buffer reused across blocks
    (memory a CPU touches once per call, not once per block): the hybrid's row-normalised
    stage a block at a time. ``z`` is valid until the next block."""
    lead, n = x.shape[:-2], x.shape[-1]
    blocks = row_blocks(x)
    rows = max((b - a for a, b in blocks), default=0)
    flat = x.new_empty(math.prod(lead) * rows * n)
    for a, b in blocks:
        z = flat[: math.prod(lead) * (b - a) * n].view(*lead, b - a, n)
        yield a, b, torch.mul(x[..., a:b, :], row[..., a:b, :], out=z)


def unformed_stage(x: torch.Tensor, gram: str, method: str, gram_dtype: str | None, reducer) -> bool:
    """Whether :func:`hybrid_factored` leaves the row-normalised stage ``Z`` of ``x`` unformed.

    It does for a right Gram with a damped inverse square root in the work dtype, and no
    compiler (which fuses ``Z`` away itself); ``reducer`` as in :func:`hybrid_factored`.
    """
    m = x.shape[-2] if reducer is None else reducer.count
    return (
        gram_side(m, x.shape[-1], gram) == "right"
        and method != "gram_newton_schulz"
        and gram_precision(x, gram_dtype) == "float32"
        and not _compiling()
    )


def _soft_row_count(total: torch.Tensor, total_sq: torch.Tensor) -> torch.Tensor:
    """``(sum_i q_i)^2 / sum_i q_i^2`` (at least 1) of the squared row norms ``q_i`` of the
    row-normalised stage, from their sum and the sum of their squares: the number of rows
    the row stage left nonzero, counted softly (the ``"rms"`` scale's ``m``, see :func:`hybrid`)."""
    return (total.pow(2) / total_sq.clamp_min(torch.finfo(total_sq.dtype).tiny)).clamp_min(1.0)


def _soft_rows(z: torch.Tensor, reducer: RowReducer | None = None) -> torch.Tensor:
    """The ``"rms"`` scale's rows of each matrix of a formed row-normalised stage ``z``
    (its sums over rows completed by ``reducer``)."""
    sq = _row_norms(z)[..., 0].square()
    return _soft_row_count(_row_sum(sq, reducer), _row_sum(sq.pow(2), reducer))


def _row_then_right(
    x: torch.Tensor,
    first: Factored,
    eps: float,
    alpha: float,
    method: str,
    steps: int,
    centered: bool,
    scale: str,
    reducer: RowReducer | None,
    damping: str,
) -> Factored:
    """The right one-sided map of ``Z = s * x - c`` (the row stage ``first``: row scales
    ``s``, shift ``c``) without forming ``Z``: its Gram, column sums and row norms are
    accumulated over blocks of rows, and the update is returned as
    ``U = s * (x @ R) - (c R + mean(Z) R)``, which equals ``Z R - mean(Z) R``.

    What :func:`_one_sided` computes on a formed ``Z``, with one full-size temporary and
    two passes over it less (a 151936 x 1024 embedding's ``Z`` is 622 MB in float32).
    """
    _check_settings(scale, damping)
    s, c = first.row, first.shift
    assert s is not None  # a row stage always has its scales
    m, n = (x.shape[-2] if reducer is None else reducer.count), x.shape[-1]
    xs, ss = _take(reducer, x), _take(reducer, s)
    C = x.new_zeros(*x.shape[:-2], n, n)
    col = x.new_zeros(*x.shape[:-2], 1, n) if centered else None
    sq1 = sq2 = None
    if scale == "rms":
        sq1, sq2 = x.new_zeros(x.shape[:-2]), x.new_zeros(x.shape[:-2])
    for _, _, z in row_scaled_blocks(xs, ss):
        if c is not None:
            z = z.sub_(c)
        if not gemm_(C, z.mT, z):
            C += z.mT @ z
        if col is not None:
            col = col + z.sum(dim=-2, keepdim=True)
        if sq1 is not None and sq2 is not None:
            sq = _row_norms(z)[..., 0].square()
            sq1, sq2 = sq1 + sq.sum(-1), sq2 + sq.square().sum(-1)
    rows = None
    if sq1 is not None and sq2 is not None:  # the rows the row-norm stage left nonzero, see hybrid
        rows = _soft_row_count(*(t if reducer is None else reducer.sum(t) for t in (sq1, sq2)))
    R = _small_factor(C, reducer, m, n, False, centered, eps, alpha, method, steps, damping, scale, rows, x.dtype)
    shift = None
    if centered and col is not None:
        mean = (col if reducer is None else reducer.sum(col)) / m
        shift = (c + mean) @ R if c is not None else mean @ R
    elif c is not None:
        shift = c @ R
    return Factored(x, row=s, right=R, shift=shift)


@_renamed_keyword("centred_input", "centered_input")
def hybrid_factored(
    D: torch.Tensor,
    order: str = "row_then_right",
    eps: float = 1e-8,
    alpha: float = 1.0,
    center: bool = False,
    method: str = "polar_express",
    steps: int = 5,
    eta: EtaRule = "inverse",
    gram: str = "auto",
    scale: str = "nu",
    reducer: RowReducer | None = None,
    centered_input: bool = False,
    damping: str = "relative",
    gram_dtype: str | None = None,
    route: str = "gram",
    narrow: bool = False,
    row_sq: torch.Tensor | None = None,
) -> Factored:
    """:func:`hybrid` in factored form: the first stage is materialised, the second is not.

    ``reducer``: the :class:`RowReducer` of a row-sharded ``D`` (right Gram only);
    ``centered_input``: as in :func:`row_norm_factored`.

    Args:
        D: work matrices ``(..., m, n)``.
        order: ``"row_then_right"``, ``"right_then_row"`` or ``"left_then_row"``.
        eps: the damping and the row-norm smoothing.
        alpha: the exponent of ``nu``.
        center: the horizontal (quotient) form.
        method: the inverse-square-root method.
        steps: iterations of the inverse square root.
        eta: the row-scaling rule, see :func:`eta_scale`.
        gram: the Gram side formed (see :func:`gram_side`).
        scale: ``"nu"`` or ``"rms"``.
        reducer: completes sums over rows split across ranks; None for a whole ``D``.
        centered_input: ``D`` already has zero column means (``centred_input=``: the
            deprecated alias, see :func:`row_norm_factored`).
        damping: ``"relative"`` or ``"absolute"``.
        gram_dtype: the precision of the one-sided stage's products (see :func:`right_spectral`).
        route: the one-sided stage's route (see :func:`right_spectral`); centring, when
            set, comes before either.
        narrow: on the direct route of ``"row_then_right"``, the polar factor in its
            iteration's dtype with the scale as a row factor (see
            :func:`~equiopt.maps.one_sided._one_sided_polar`).
        row_sq: ``"row_then_right"`` of an uncentred, whole ``D``: the sums of squares of its
            rows, ``(..., m, 1)``, where they are known (the row stage's norms are their
            square roots).

    Returns:
        The update as a :class:`Factored`.
    """
    if order not in HYBRID_ORDERS:
        raise ValueError(f"unknown hybrid order {order!r}; valid: {', '.join(HYBRID_ORDERS)}")
    if row_sq is not None and (order != "row_then_right" or center or reducer is not None):
        raise ValueError("row_sq: the rows' sums of squares of a whole, uncentred D, for order 'row_then_right'")
    # whichever stage is one-sided has x's shape, dtype and device: one route decision serves
    x, route = _one_sided_input(D, center, reducer, centered_input, route, method, steps, gram_dtype)
    known = None if row_sq is None else row_sq.to(x.dtype).sqrt()
    if order == "row_then_right" and route == "gram" and unformed_stage(x, gram, method, gram_dtype, reducer):
        stage = _row_factors(x, eta, eps, center, reducer, norms=known)
        return _row_then_right(x, stage, eps, alpha, method, steps, center, scale, reducer, damping)
    if order == "row_then_right" and route == "direct":
        # the row stage is formed a chunk of the batch at a time, as the polar factor is
        rows_of = _soft_rows if scale == "rms" else None
        # the rows' norms serve the row stage and the stage's Frobenius norm: D is read once for both
        norms = known if known is not None else _row_norms(x) if reducer is None and not center else None
        stage = _row_factors(x, eta, eps, center, reducer, norms=norms)
        stage_sq = None
        if norms is not None and stage.row is not None:
            stage_sq = (norms * stage.row).square().sum(dim=(-2, -1), keepdim=True)
        return _one_sided(
            stage, eps, alpha, method, steps, center, gram, scale, None, reducer, damping, gram_dtype, route,
            narrow=narrow, rows_of=rows_of, stage_sq=stage_sq,
        )  # fmt: skip
    if order == "row_then_right":
        z = materialize(_row_factors(x, eta, eps, center, reducer, norms=known))
        rows = None
        if scale == "rms":  # the rows the row-norm stage left nonzero, see hybrid
            rows = _soft_rows(z, reducer)
        f = _one_sided(z, eps, alpha, method, steps, center, gram, scale, rows, reducer, damping, gram_dtype, route)
        # the direct route's update is the whole result, not a stage: a non-finite value stays for the finite check
        return _clean_stage(f) if route == "gram" else f
    z = materialize(
        _one_sided(x, eps, alpha, method, steps, center, gram, scale, None, reducer, damping, gram_dtype, route)
    )
    f = _clean_stage(_row_factors(z, eta, eps, center, reducer))
    if scale == "rms":  # rows of unit RMS
        k = z.shape[-1] ** 0.5
        f = f._replace(row=f.row * k, shift=None if f.shift is None else f.shift * k)
    return f
