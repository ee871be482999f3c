"""Symmetry-compatible update maps on work matrices ``D`` of shape ``(..., m, n)``.

Rows are the symmetry axis (vocabulary items, intermediate neurons, experts). Every map
is a pure function; every reduction (row norms, means, Gram matrices, traces, ``nu``)
is taken per matrix, so a batch of experts or heads gives what a loop over them gives.
References are to the paper (Lau and Su, "Symmetry-Compatible Principle for Optimizer
Design"): section 3.3 for the LPRO maps, 3.5 for routers, Algorithms 1 and 2.

``center=True`` gives the horizontal (quotient) versions used for LM heads and routers:
the input is centred, ``D_c = Pi D`` with ``Pi = I - 11^T/m``, every row-wise stage is
re-projected, and the final update is projected by ``Pi`` (paper eq. for the horizontal
LM-head row-norm update and Algorithm 2).

Low-precision inputs (bfloat16, float16) are computed in float32 and returned in their
own dtype; float32 and float64 inputs are computed in their dtype (the Gram inverse
square root itself runs in float32 except for ``method="exact"``).

Every map is computed in *factored form* (:class:`Factored`): ``U = s * (L X R) - 1 c``
with at most one of the row scales ``s``, left factor ``L`` or right factor ``R``, and
an optional row-shared shift ``c``. :func:`materialize` multiplies it out; the
optimizer instead folds the learning rate into the small factor and accumulates the
product straight into the parameter (one GEMM, no full-size update tensor), and the
centring of the quotient maps costs a vector, not a pass over the matrix.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from .linalg import default_dtype, inv_sqrt, polar
from .linalg.device_choices import decides_like
from .linalg.products import OUT_DTYPE_MM, mm, split, split_gram, split_times

EtaRule = str | Callable[[torch.Tensor], torch.Tensor]
ETA_RULES = ("inverse", "normalize", "rms")
HYBRID_ORDERS = ("row_then_right", "right_then_row", "left_then_row")
SCALES = ("nu", "rms")


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


GRAM_DTYPES = ("auto", "float32", "bfloat16", "bfloat16x6")

# "auto" takes the split products on CUDA for matrices whose smaller side reaches this: the
# products then dominate the map (a few small ones stay at float32, whose launches are fewer)
AUTO_SPLIT_MIN = 512

_OUT_DTYPE_MM = OUT_DTYPE_MM


def gram_precision(x: torch.Tensor, gram_dtype: str | None) -> str:
    """The precision the one-sided maps' products of ``x`` run at: ``"float32"`` (strict, the
    compute dtype: float64 inputs stay float64), ``"bfloat16"`` or ``"bfloat16x6"``.

    ``gram_dtype``: one of :data:`GRAM_DTYPES`, or None for ``"float32"``. ``"auto"`` is the
    fastest precision within 0.5 % of float64 at condition numbers up to 1e3: the split
    products (:mod:`equiopt.linalg.products`) on CUDA, where they run on tensor cores, for
    matrices whose smaller side is at least :data:`AUTO_SPLIT_MIN`; strict float32 elsewhere.
    """
    if gram_dtype not in (None, *GRAM_DTYPES):
        raise ValueError(f"unknown gram_dtype {gram_dtype!r}; valid: {', '.join(GRAM_DTYPES)}")
    if gram_dtype in (None, "float32") or x.dtype == torch.float64:
        return "float32"
    if gram_dtype == "auto":
        wide = min(x.shape[-2:]) >= AUTO_SPLIT_MIN
        return "bfloat16x6" if decides_like(x) == "cuda" and OUT_DTYPE_MM and wide else "float32"
    return gram_dtype


def _low(x: torch.Tensor, gram_dtype: str | None) -> torch.Tensor | None:
    """``x`` in the Gram precision: None for float32 (or wider), ``x`` rounded to bfloat16,
    or its three bfloat16 parts side by side (:func:`~equiopt.linalg.products.split`)."""
    precision = gram_precision(x, gram_dtype)
    if precision == "float32":
        return None
    return x.to(torch.bfloat16) if precision == "bfloat16" else split(x)


def _is_split(low: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``low`` holds the split parts of ``x`` (not ``x`` rounded once)."""
    return low.shape[-1] != x.shape[-1]


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[-2:]) if t.ndim != 3 else t


def low_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for bfloat16 operands, accumulated in float32, returned in float32 to
    float32 precision (what a Gram needs: rounding its entries to bfloat16, a relative
    2^-9, would swamp its small eigenvalues and can leave it indefinite).

    On CUDA with ``out_dtype`` support that is one product; elsewhere two: ``hi = a @ b``
    rounded to bfloat16, then the residual ``a @ b - hi`` (one more product, whose beta term
    is added in float32 before rounding), so ``hi + residual`` is within about 2^-17 of the
    float32 product of the same operands.
    """
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = _as_3d(a.expand(*lead, *a.shape[-2:]))
    b3 = _as_3d(b.expand(*lead, *b.shape[-2:]))
    if _OUT_DTYPE_MM and decides_like(a) == "cuda":
        out = torch.bmm(a3, b3, out_dtype=torch.float32)
    else:
        hi = torch.bmm(a3, b3)
        out = hi.float() + torch.baddbmm(hi, a3, b3, beta=-1.0).float()
    return out.reshape(*lead, *out.shape[-2:])


def low_times(low: torch.Tensor, factor: torch.Tensor, right: bool = True) -> torch.Tensor:
    """``low @ factor`` (or ``factor @ low``) in float32, for a bfloat16 ``low`` and a float32
    ``factor`` (the small ``R``): the factor is split as ``hi + lo``, both bfloat16, so its
    own rounding (which the condition number would amplify like the operand's) is gone; the
    two products accumulate in float32 and round to bfloat16 once each.
    """
    hi = factor.to(low.dtype)
    lo = (factor - hi.float()).to(low.dtype)
    if right:
        return (low @ hi).float() + (low @ lo).float()
    return (hi @ low).float() + (lo @ low).float()


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


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def _row_factors(
    x: torch.Tensor,
    eta: EtaRule,
    eps: float,
    centered: bool,
    reducer: RowReducer | None = None,
    col_reducer: RowReducer | None = None,
) -> Factored:
    """``Pi Diag(eta(||x_i:||)) x`` for an ``x`` that is already centred when ``centered``.

    The final projection subtracts the column means ``s^T x / m`` of the scaled rows,
    computed as one vector-matrix product instead of a second pass over the matrix.
    ``col_reducer``: ``x`` holds some of the columns (a split of the work columns); the
    squared row norms, one per row, are completed by it (its ``count`` is the column count).
    """
    if col_reducer is None:
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

    Returns:
        The update as a :class:`Factored`.
    """
    x = _maybe_center(D.to(_compute_dtype(D)), center, reducer, centered_input)
    return _row_factors(x, eta, eps, center, reducer, col_reducer)


GRAM_SIDES = ("auto", "right", "left")


def gram_side(m: int, n: int, gram: str = "auto") -> str:
    """``"left"`` or ``"right"``: the Gram matrix a one-sided map of an ``m x n`` matrix forms.

    Args:
        m: rows of the work matrix.
        n: columns of the work matrix.
        gram: ``"auto"`` (the smaller Gram, ``"left"`` when ``m < n``), ``"left"`` or ``"right"``.

    Returns:
        ``"left"`` (``D D^T``, ``m x m``) or ``"right"`` (``D^T D``, ``n x n``).

    Raises:
        ValueError: for another ``gram``.
    """
    if gram not in GRAM_SIDES:
        raise ValueError(f"unknown gram side {gram!r}; valid: {', '.join(GRAM_SIDES)}")
    return "left" if gram == "left" or (gram == "auto" and m < n) else "right"


def _normalized_gram(C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C 2^-k, 2^(-k/2))`` per matrix, with the even ``k`` that puts the mean eigenvalue
    ``tr(C) / n`` of the normalised Gram in ``[1/4, 1)`` (``k = 0`` for a zero Gram).

    The maps are homogeneous, so the inverse square root runs on a Gram of unit scale
    whatever the gradient's (no ``C^2`` overflow at large entries, no damping swamping
    small ones) and the scale comes back exactly: powers of two multiply without rounding,
    so ``D (C + d I)^(-1/2) = D (C 2^-k + d 2^-k I)^(-1/2) 2^(-k/2)`` bit for bit.
    """
    mean = torch.diagonal(C, dim1=-2, dim2=-1).sum(-1) / C.shape[-1]
    _, e = torch.frexp(mean)
    k = e + (e & 1)
    return C * torch.exp2(-k.to(C.dtype))[..., None, None], torch.exp2(
        torch.div(-k, 2, rounding_mode="floor").to(C.dtype)
    )


def _damping(trace: torch.Tensor, eps: float, half: torch.Tensor, damping: str, r: int) -> torch.Tensor:
    """The damping added to a normalised Gram of trace ``trace`` (see :func:`_normalized_gram`), ``(..., 1, 1)``.

    ``"relative"`` (default): ``eps ||D||_F^2 / r``, ``r = min(m, n)``, i.e. ``eps`` times
    the mean of the (at most ``r``) nonzero eigenvalues of a full-rank Gram: the damped
    Gram of ``D`` is ``D^T D + eps (||D||_F^2 / r) I``, the same map for every scale of
    ``D``, and the same on either side (both Grams have trace ``||D||_F^2``).
    ``"absolute"``: the paper's ``D^T D + eps I`` (``eps`` in the units of ``D^T D``, so
    the damping dominates once the Gram's eigenvalues fall towards ``eps``: gradients with
    entries of 1e-6 on a vocabulary matrix).
    """
    if damping == "absolute":
        return (eps * half.square())[..., None, None]
    mean = trace / r
    return (eps * torch.where(mean > 0, mean, torch.ones_like(mean)))[..., None, None]


DAMPINGS = ("relative", "absolute")

ROUTES = ("auto", "gram", "direct")

#: Product rates (FLOP/s) by precision on the device types whose rates are known: an
#: H100's nominal dense rates (:data:`equiopt.roofline.H100`, which the roofline calibrates
#: against measured steps). ``"auto"`` keeps the Gram route on other devices (the CPU, the
#: meta device outside :func:`~equiopt.linalg.device_choices.decide_as`).
ROUTE_RATES: dict[str, dict[str, float]] = {"cuda": {"bfloat16": 700e12, "float32": 55e12}}

# Polar methods the direct route takes for each inverse-square-root method
_DIRECT_METHODS = {"polar_express": "polar_express", "newton_schulz": "newton_schulz", "exact": "exact"}


def route_flops(m: int, n: int, steps: int, route: str, precision: str, iteration: torch.dtype) -> dict[str, float]:
    """Matrix-product FLOPs by precision of one one-sided map of an ``m x n`` matrix.

    With ``k = max(m, n)``, ``r = min(m, n)``: the Gram route forms the ``r x r`` Gram
    (``2 k r^2``), runs the coupled inverse square root (``4 steps + 1`` products of
    ``2 r^3``, see :func:`~equiopt.linalg.inv_sqrt`) and the product with ``R``
    (``2 k r^2``), each at ``precision`` (:func:`gram_precision`; ``"bfloat16x6"``: six
    bfloat16 products each, four for the Gram). The direct route runs Polar Express on the
    matrix itself, ``steps`` iterations of ``x x^T``, ``h(G)`` and ``h(G) x``
    (``4 k r^2 + 2 r^3`` each) in ``iteration`` (Muon's cost).
    """
    k, r = max(m, n), min(m, n)
    side, inverse = 2.0 * k * r * r, (8.0 * steps + 2.0) * r**3
    if route == "direct":
        return {"bfloat16" if iteration == torch.bfloat16 else "float32": steps * (2 * side + 2.0 * r**3)}
    if precision == "bfloat16x6":
        return {"bfloat16": 4 * side + 6 * inverse + 6 * side}
    if precision == "bfloat16":
        return {"bfloat16": (1 if OUT_DTYPE_MM else 2) * side + 2 * side, "float32": inverse}
    return {"float32": 2 * side + inverse}


def route_costs(
    x: torch.Tensor, method: str = "polar_express", steps: int = 5, gram_dtype: str | None = None
) -> dict[str, float] | None:
    """The estimated seconds of each route (``"gram"``, ``"direct"``) of a one-sided map of
    ``x`` (``(..., m, n)``) on the device ``x`` decides as: :func:`route_flops` at the
    device's :data:`ROUTE_RATES` for each precision. None where the rates are unknown."""
    rates = ROUTE_RATES.get(decides_like(x))
    if rates is None:
        return None
    m, n = x.shape[-2:]
    batch = math.prod(x.shape[:-2])
    precision = gram_precision(x, gram_dtype)
    iteration = default_dtype(_DIRECT_METHODS.get(method, method), x.device)
    return {
        route: batch * sum(f / rates[p] for p, f in route_flops(m, n, steps, route, precision, iteration).items())
        for route in ("gram", "direct")
    }


def one_sided_route(
    x: torch.Tensor,
    route: str = "auto",
    method: str = "polar_express",
    steps: int = 5,
    gram_dtype: str | None = None,
    reducer: RowReducer | None = None,
) -> str:
    """The route a one-sided map (or a hybrid's one-sided stage) of ``x`` takes: ``"gram"``
    (Gram, coupled inverse square root, product: Algorithm 1 as written) or ``"direct"``
    (the polar factor of ``x`` itself by Polar Express in the iteration's dtype, as Muon
    computes it, with ``nu = tr(x^T P)``; see :func:`_one_sided_polar`).

    ``route="auto"`` takes the cheaper of the two by :func:`route_costs`: the products'
    FLOPs charged at the rate of their precision on ``x``'s device. It keeps the Gram route
    where the rates are unknown (CPU), for float64 inputs (the direct route would iterate
    below their precision), for methods other than Polar Express, and for a row-sharded
    ``x`` (``reducer`` set): the Gram route is the one whose only cross-shard operation is
    the all-reduce of a ``d x d`` Gram, while the direct route needs the whole matrix.

    Raises:
        ValueError: for an unknown ``route``, or ``"direct"`` with a ``reducer``.
    """
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; valid: {', '.join(ROUTES)}")
    if route == "direct":
        if reducer is not None:
            raise ValueError(
                "route 'direct' needs the whole work matrix; a row-sharded one takes route 'gram' "
                "(or 'auto'), or is gathered to one rank"
            )
        return "direct"
    if route == "gram" or reducer is not None or method != "polar_express" or x.dtype == torch.float64:
        return "gram"
    costs = route_costs(x, method, steps, gram_dtype)
    return "direct" if costs is not None and costs["direct"] < costs["gram"] else "gram"


def _one_sided(
    x: torch.Tensor,
    eps: float,
    alpha: float,
    method: str,
    steps: int,
    centered: bool,
    gram: str,
    scale: str = "nu",
    rows: torch.Tensor | None = None,
    reducer: RowReducer | None = None,
    damping: str = "relative",
    gram_dtype: str | None = None,
    route: str = "gram",
) -> Factored:
    """``nu^alpha D (D^T D + eps I)^(-1/2)``, which equals ``nu^alpha (D D^T + eps I)^(-1/2) D``.

    The two one-sided maps are the same function of ``D`` (push-through identity
    ``D f(D^T D) = f(D D^T) D`` for any spectral ``f``; ``nu = tr(C R)`` sums
    ``lambda / sqrt(lambda + eps)`` over the shared nonzero eigenvalues either way), so
    ``gram="auto"`` forms the smaller Gram matrix: a wide SwiGLU expert block or a router
    never pays for an ``n x n`` inverse square root when an ``m x m`` one gives the same
    update. ``"right"``/``"left"`` force a side (the literal Algorithm 1 branches).

    ``nu^alpha`` is folded into the small factor ``R``. With ``centered`` (``x`` already
    centred) the result is projected by ``Pi`` through its column means, ``mean(x) R``
    on the right side and ``mean_rows(R) x`` on the left: vectors, not passes.
    ``scale`` picks the factor in front of the damped polar factor, see :func:`_scale`
    (``rows``: the number of rows it counts, per matrix; default all ``m``).

    With ``reducer`` (a row-sharded ``x``) only the right side can be formed from shards:
    the partial Grams are summed by ``reducer``, ``R`` is computed from the reduced Gram
    on every rank and ``x R`` stays local.

    ``gram_dtype="bfloat16"``: the Gram is formed from ``x`` rounded to bfloat16 (float32
    accumulation and a float32-precise result, :func:`low_product`) and the final product
    ``x R`` is taken in bfloat16 too; the inverse square root, ``nu`` and the shift stay in
    float32. The rounding of ``x`` costs accuracy in the directions of its small singular
    values: the relative error grows like ``2^-9`` times the condition number (docs: "Gram
    precision"). ``"bfloat16x6"``: the Gram, every product of the inverse square root and
    the final product from six bfloat16 products each (four for the Gram) of ``x``'s three
    bfloat16 parts: float32's accuracy on tensor cores (:mod:`equiopt.linalg.products`).
    ``"auto"``: see :func:`gram_precision`.

    ``route``: ``"gram"`` (the above), ``"direct"`` (the polar factor of ``x`` itself, see
    :func:`_one_sided_polar`) or ``"auto"`` (:func:`one_sided_route`).
    """
    _check_settings(scale, damping)
    if one_sided_route(x, route, method, steps, gram_dtype, reducer) == "direct" and method != "gram_newton_schulz":
        return _one_sided_polar(x, eps, alpha, steps, centered, scale, rows, _DIRECT_METHODS[method], None)
    m, n = (x.shape[-2] if reducer is None else reducer.count), x.shape[-1]
    left = gram_side(m, n, gram) == "left"
    if reducer is not None and (left or method == "gram_newton_schulz"):
        raise ValueError(
            "a row-sharded work matrix takes only the right Gram with a damped inverse square root; "
            "gather it to one rank for the left Gram or the Gram Newton-Schulz polar factor"
        )
    if method == "gram_newton_schulz":
        return _one_sided_polar(x, eps, alpha, steps, centered, scale, rows)
    low = _low(x, gram_dtype)
    split_products = low is not None and _is_split(low, x)
    if left:
        if low is None:
            C = mm(x, x.mT)
        else:
            C = split_gram(low, left=True) if split_products else low_product(low, low.mT)
    else:
        part = _take(reducer, x if low is None else low)
        if low is None:
            C = mm(part.mT, part)
        else:
            C = split_gram(part) if split_products else low_product(part.mT, part)

    products = "bfloat16x6" if split_products else "float32"
    R = _small_factor(
        C, reducer, m, n, left, centered, eps, alpha, method, steps, damping, scale, rows, x.dtype, products
    )
    if left:
        return Factored(x, left=R, shift=R.mean(dim=-2, keepdim=True) @ x if centered else None, low=low)
    return Factored(x, right=R, shift=_col_mean(x, reducer) @ R if centered else None, low=low)


def _check_settings(scale: str, damping: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(SCALES)}")
    if damping not in DAMPINGS:
        raise ValueError(f"unknown damping {damping!r}; valid: {', '.join(DAMPINGS)}")


def _small_factor(
    C: torch.Tensor,
    reducer: RowReducer | None,
    m: int,
    n: int,
    left: bool,
    centered: bool,
    eps: float,
    alpha: float,
    method: str,
    steps: int,
    damping: str,
    scale: str,
    rows: torch.Tensor | None,
    dtype: torch.dtype,
    products: str = "float32",
) -> torch.Tensor:
    """The one-sided maps' small factor from the Gram ``C`` (this rank's partial sums of a
    right Gram when ``reducer`` is set): ``nu^alpha (C + eps I)^(-1/2)``, or the factor of
    ``scale``, matrix by matrix (through :func:`_sum_then`, which may divide the matrices
    among the reducer's ranks)."""

    def factor_of(C: torch.Tensor, rows) -> torch.Tensor:
        C, half = _normalized_gram(C)
        trace = torch.diagonal(C, dim1=-2, dim2=-1).sum(-1)  # ||D||_F^2, normalised
        A = C
        if left and centered:
            # C = D_c D_c^T has 1 in its null space. Lifting that direction to the mean
            # eigenvalue, A = C + (tr C / m) 11^T / m, leaves (A + eps I)^(-1/2) unchanged on
            # 1-perp (the paper's inverse square root "on the centred expert subspace") and
            # spares the iteration the eps^(-1/2) eigenvalue that would amplify rounding.
            A = C + (trace[..., None, None] / m / m) * torch.ones_like(C)
        R = inv_sqrt(A, _damping(trace, eps, half, damping, min(m, n)), method, steps, products=products).to(dtype)
        factor = half
        if alpha != 0 or scale != "nu":
            nu = (C * R.mT).sum(dim=(-2, -1))  # of the normalised Gram; tr(C R) of D's is nu / half
            fro2 = trace
            if scale == "nu":
                nu = nu / half
                if damping == "absolute":
                    nu = nu.clamp_min(eps)
            factor = half * _scale(nu, fro2, alpha, m if rows is None else rows, n, centered, eps, scale)
        return R * factor[..., None, None]

    if left or reducer is None:
        return factor_of(C, rows)
    if rows is None:
        return _sum_then(reducer, C, lambda C: factor_of(C, None))
    return _sum_then(reducer, C, factor_of, rows)


def _scale(
    nu: torch.Tensor, fro2: torch.Tensor, alpha: float, m, n: int, centered: bool, eps: float, scale: str
) -> torch.Tensor:
    """The factor multiplying the damped polar factor ``P = D (D^T D + eps I)^(-1/2)``.

    ``"nu"`` (the paper's Algorithms 1-2): ``nu^alpha``. ``nu`` estimates the nuclear norm
    of ``D``, so the step grows with the scale of ``D`` and with its shape: for the
    hybrid's row-normalised ``Z`` (unit rows, ``m >= n``, well conditioned) ``nu = sqrt(m n)``
    and every row of ``nu P`` has norm ``n``, so the best learning rate moves with the width.

    ``"rms"`` (scale-transferable): ``rho^alpha sqrt(m n / r)`` with ``r = min(m, n)``
    (``min(m - 1, n)`` when centred: the rank bound) and ``rho = nu / (sqrt(r) ||D||_F)``,
    the normalised nu: ``nu`` divided by the value it takes for a well-conditioned matrix of
    the same shape and Frobenius norm. Since ``||P||_F^2 <= rank(D) <= r`` and
    ``nu <= sqrt(rank) ||D||_F``, the update's RMS ``||U||_F / sqrt(m n)`` is at most 1, and
    equals 1 (up to the damping) exactly when ``D`` has ``r`` equal singular values, for
    every width, vocabulary and scale of ``D``: the learning rate is the update RMS of a
    well-conditioned step, as for AdamW. ``rho`` in ``(0, 1]`` keeps the role of
    ``nu^alpha``: steps along low-rank or ill-conditioned directions are shortened. ``nu``,
    ``||D||_F^2 = tr C`` and the shape are invariant under ``D -> Q1 D Q2`` for orthogonal
    (hence permutation) ``Q1``, ``Q2``, so the map keeps every equivariance the paper's has.
    """
    if scale == "nu":
        return nu.pow(alpha)
    if isinstance(m, torch.Tensor):  # a per-matrix (soft) count of rows, see hybrid
        r = torch.minimum(m, torch.full_like(m, float(n))).clamp_min(1.0)
    else:
        r = max(1, min(m - 1 if centered else m, n))
    rho = nu / (r**0.5 * fro2.clamp_min(0).sqrt().clamp_min(eps))
    return rho.clamp(max=1.0).pow(alpha) * (m * n / r) ** 0.5


def _one_sided_polar(
    x: torch.Tensor,
    eps: float,
    alpha: float,
    steps: int,
    centered: bool,
    scale: str = "nu",
    rows: torch.Tensor | None = None,
    method: str = "gram_newton_schulz",
    dtype: torch.dtype | None = torch.float32,
) -> Factored:
    """The one-sided map from the undamped polar factor ``U`` of ``D`` computed directly,
    with ``nu = tr(U^T D)``, the nuclear norm, which is ``tr(C R)`` at ``eps = 0``.

    ``method="gram_newton_schulz"`` (float32) is the paper's Gram Newton-Schulz variant;
    ``"polar_express"`` in the iteration's dtype (``dtype=None``: bfloat16 where the device
    multiplies it natively, :func:`~equiopt.linalg.default_dtype`) is the direct route
    (:func:`one_sided_route`), Muon's iteration on ``D``. Damping: where ``eps`` is
    negligible against the smallest squared singular value, ``D (D^T D + eps I)^(-1/2)``
    is ``U`` and the routes agree; the damping is not applied here, so a zero singular
    value stays zero but a tiny one is mapped towards 1 (as Muon maps it) where the Gram
    route's ``eps`` maps it towards 0. ``D`` is centred before (``centered``), and the
    result projected by its row mean."""
    out = polar(x, method=method, steps=steps, dtype=dtype).to(x.dtype)
    if alpha != 0 or scale != "nu":
        nu = (out * x).sum(dim=(-2, -1)).clamp_min(eps)
        # ||D||_F^2 is read by the "rms" scale only: one reduction over D, no squared copy
        fro2 = torch.linalg.vector_norm(x, dim=(-2, -1)).square() if scale == "rms" else nu
        m = x.shape[-2] if rows is None else rows
        out = out.mul_(_scale(nu, fro2, alpha, m, x.shape[-1], centered, eps, scale)[..., None, None])
    return Factored(out, shift=out.mean(dim=-2, keepdim=True) if centered else None)


@_renamed_keyword("centred_input", "centered_input")
def one_sided_factored(
    D: torch.Tensor,
    eps: float = 1e-8,
    alpha: float = 0.0,
    center: bool = False,
    method: str = "polar_express",
    steps: int = 5,
    gram: str = "auto",
    scale: str = "nu",
    reducer: RowReducer | None = None,
    centered_input: bool = False,
    damping: str = "relative",
    gram_dtype: str | None = None,
    route: str = "gram",
) -> Factored:
    """:func:`right_spectral` (equivalently :func:`left_spectral`) in factored form.

    ``reducer``: the :class:`RowReducer` of a row-sharded ``D`` (right Gram only);
    ``centered_input``: as in :func:`row_norm_factored`.

    Args:
        D: work matrices ``(..., m, n)``.
        eps: the damping (see :func:`right_spectral`).
        alpha: the exponent of the scale factor.
        center: the horizontal (quotient) form.
        method: the inverse-square-root method (:data:`equiopt.linalg.INV_SQRT_METHODS`).
        steps: iterations of the inverse square root.
        gram: the Gram side formed (see :func:`gram_side`).
        scale: ``"nu"`` (the paper's ``nu^alpha``) or ``"rms"``.
        reducer: completes sums over rows split across ranks; None for a whole ``D``.
        centered_input: ``D`` already has zero column means (``centred_input=``: the
            deprecated alias, see :func:`row_norm_factored`).
        damping: ``"relative"`` or ``"absolute"``.
        gram_dtype: the precision of the Gram, the inverse square root and the final
            product: one of :data:`GRAM_DTYPES`, None for ``"float32"`` (see
            :func:`gram_precision` and :func:`_one_sided`).
        route: ``"gram"``, ``"direct"`` or ``"auto"`` (see :func:`right_spectral`).

    Returns:
        The update as a :class:`Factored`.
    """
    x = _maybe_center(D.to(_compute_dtype(D)), center, reducer, centered_input)
    return _one_sided(
        x,
        eps,
        alpha,
        method,
        steps,
        center,
        gram,
        scale,
        reducer=reducer,
        damping=damping,
        gram_dtype=gram_dtype,
        route=route,
    )


ONE_SIDED_METHODS = ("polar_express", "newton_schulz", "exact", "gram_newton_schulz")


def right_spectral(
    D: torch.Tensor,
    eps: float = 1e-8,
    alpha: float = 0.0,
    center: bool = False,
    method: str = "polar_express",
    steps: int = 5,
    gram: str = "auto",
    scale: str = "nu",
    damping: str = "relative",
    gram_dtype: str | None = None,
    route: str = "gram",
) -> torch.Tensor:
    """Damped right-polar map ``nu^alpha D (D^T D + eps I)^(-1/2)`` (Algorithm 1, RightPolarGradM).

    Right-orthogonal and left-permutation (indeed left-orthogonal) equivariant. With
    ``center=True`` the input is centred and the result projected: the LM-head form
    ``Pi D_c (D_c^T D_c + eps I)^(-1/2)``. ``gram`` picks the Gram matrix that is
    inverted (default: the smaller; the result is the same, see :func:`_one_sided`).
    ``scale="rms"`` replaces ``nu^alpha`` by the scale-transferable factor of :func:`_scale`.

    Args:
        D: work matrices ``(..., m, n)``.
        eps: the damping: ``eps`` times the mean eigenvalue of the Gram
            (``damping="relative"``), or added as is (``"absolute"``, the paper's form).
        alpha: the exponent of ``nu`` (0: the damped polar factor alone).
        center: centre the input and project the result (LM heads).
        method: the inverse-square-root method (:data:`equiopt.linalg.INV_SQRT_METHODS`).
        steps: iterations of the inverse square root.
        gram: ``"auto"``, ``"right"`` or ``"left"``: the Gram matrix formed.
        scale: ``"nu"`` (``nu^alpha``) or ``"rms"`` (an update of RMS about 1).
        damping: ``"relative"`` (default) or ``"absolute"``.
        gram_dtype: the precision of the Gram, the inverse square root and the final
            product: one of :data:`GRAM_DTYPES`, None for ``"float32"`` (see
            :func:`gram_precision`; :func:`_one_sided` for what each costs).
        route: ``"gram"`` (default: Gram, inverse square root, product), ``"direct"``
            (Polar Express on ``D`` itself in the iteration's dtype, with
            ``nu = tr(D^T P)``: Muon's accuracy, undamped) or ``"auto"`` (the cheaper on
            ``D``'s device, :func:`one_sided_route`).

    Returns:
        The update, of ``D``'s shape and dtype.
    """
    _check(D, "right_spectral")
    f = one_sided_factored(
        D, eps, alpha, center, method, steps, gram, scale, damping=damping, gram_dtype=gram_dtype, route=route
    )
    return materialize(f).to(D.dtype)


def left_spectral(
    D: torch.Tensor,
    eps: float = 1e-8,
    alpha: float = 0.0,
    center: bool = False,
    method: str = "polar_express",
    steps: int = 5,
    gram: str = "auto",
    scale: str = "nu",
    damping: str = "relative",
    gram_dtype: str | None = None,
    route: str = "gram",
) -> torch.Tensor:
    """Damped left-polar map ``nu^alpha (D D^T + eps I)^(-1/2) D`` (Algorithm 1, LeftPolarGradM).

    With ``center=True`` it is the router map ``(D_c D_c^T + eps I)^(-1/2) D_c``: the
    damped inverse square root leaves the centred expert subspace invariant, and the
    final projection removes what rounding leaves along ``1`` (amplified by
    ``eps^(-1/2)`` there, since ``1`` spans the Gram's null space). It is the same
    function of ``D`` as :func:`right_spectral`; ``gram`` picks the side computed.
    ``scale="rms"`` replaces ``nu^alpha`` by the scale-transferable factor of :func:`_scale`.

    Args:
        D: work matrices ``(..., m, n)``.
        eps: the damping, as in :func:`right_spectral`.
        alpha: the exponent of ``nu``.
        center: centre the input and project the result (routers).
        method: the inverse-square-root method (:data:`equiopt.linalg.INV_SQRT_METHODS`).
        steps: iterations of the inverse square root.
        gram: ``"auto"``, ``"right"`` or ``"left"``: the Gram matrix formed.
        scale: ``"nu"`` or ``"rms"``.
        damping: ``"relative"`` (default) or ``"absolute"``.
        gram_dtype: the products' precision, as in :func:`right_spectral`.
        route: ``"gram"``, ``"direct"`` or ``"auto"``, as in :func:`right_spectral`.

    Returns:
        The update, of ``D``'s shape and dtype.
    """
    _check(D, "left_spectral")
    f = one_sided_factored(
        D, eps, alpha, center, method, steps, gram, scale, damping=damping, gram_dtype=gram_dtype, route=route
    )
    return materialize(f).to(D.dtype)


def spectral(
    D: torch.Tensor,
    method: str = "polar_express",
    steps: int = 5,
    dtype: torch.dtype | None = None,
    reducer: RowReducer | None = None,
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

    Returns:
        The polar factor, of ``D``'s shape and dtype.
    """
    _check(D, "spectral")
    return polar(D, method=method, steps=steps, dtype=dtype, reducer=reducer)


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


def _gemm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``out += a @ b`` in place for 2-D or 3-D operands; False if the shapes don't allow it."""
    if out.ndim == 2 and a.ndim == 2 and b.ndim == 2:
        out.addmm_(a, b)
        return True
    if out.ndim == 3 and a.ndim == 3 and b.ndim == 3:
        out.baddbmm_(a, b)
        return True
    return False


def _unformed_stage(x: torch.Tensor, gram: str, method: str, gram_dtype: str | None, reducer) -> bool:
    """Whether the hybrid's row-normalised stage ``Z`` can be left unformed: a right Gram
    with a damped inverse square root in the work dtype, and no compiler (which fuses ``Z``
    away itself)."""
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
        if not _gemm_(C, z.mT, z):
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

    Returns:
        The update as a :class:`Factored`.
    """
    if order not in HYBRID_ORDERS:
        raise ValueError(f"unknown hybrid order {order!r}; valid: {', '.join(HYBRID_ORDERS)}")
    x = _maybe_center(D.to(_compute_dtype(D)), center, reducer, centered_input)
    # the stage the one-sided map takes has x's shape, dtype and device: one decision for both
    route = one_sided_route(x, route, method, steps, gram_dtype, reducer)
    if order == "row_then_right" and route == "gram" and _unformed_stage(x, gram, method, gram_dtype, reducer):
        return _row_then_right(
            x, _row_factors(x, eta, eps, center, reducer), eps, alpha, method, steps, center, scale, reducer, damping
        )
    if order == "row_then_right":
        z = materialize(_row_factors(x, eta, eps, center, reducer))
        rows = None
        if scale == "rms":  # the rows the row-norm stage left nonzero, see hybrid
            sq = _row_norms(z)[..., 0].square()
            rows = _soft_row_count(_row_sum(sq, reducer), _row_sum(sq.pow(2), reducer))
        f = _one_sided(z, eps, alpha, method, steps, center, gram, scale, rows, reducer, damping, gram_dtype, route)
        # the direct route's update is the whole result, not a stage: a non-finite value stays for the finite check
        return _clean_stage(f) if route == "gram" else f
    z = materialize(
        _one_sided(
            x,
            eps,
            alpha,
            method,
            steps,
            center,
            gram,
            scale,
            reducer=reducer,
            damping=damping,
            gram_dtype=gram_dtype,
            route=route,
        )
    )
    f = _clean_stage(_row_factors(z, eta, eps, center, reducer))
    if scale == "rms":  # rows of unit RMS
        k = z.shape[-1] ** 0.5
        f = f._replace(row=f.row * k, shift=None if f.shift is None else f.shift * k)
    return f


__all__ = [
    "Factored",
    "RowReducer",
    "gram_side",
    "materialize",
    "row_norm_factored",
    "one_sided_factored",
    "hybrid_factored",
    "center",
    "row_norm",
    "right_spectral",
    "left_spectral",
    "spectral",
    "hybrid",
    "spectral_row",
    "spectral_row_factored",
    "normuon_rows",
    "normuon_moments_",
    "eta_scale",
    "ETA_RULES",
    "HYBRID_ORDERS",
    "GRAM_SIDES",
    "ONE_SIDED_METHODS",
    "SCALES",
    "DAMPINGS",
    "GRAM_DTYPES",
    "ROUTES",
    "ROUTE_RATES",
    "route_flops",
    "route_costs",
    "one_sided_route",
    "low_product",
    "gram_precision",
    "row_blocks",
    "row_scaled_blocks",
    "low_times",
]
