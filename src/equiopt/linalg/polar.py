"""Orthogonal polar factor ``X (X^T X)^(-1/2) = U V^T`` of batched matrices.

Methods (each matrix of a batch is normalised on its own, by its Frobenius norm, which
bounds the spectral norm, with a 1 % margin except in ``"newton_schulz_torch"``):

``"polar_express"``
    The Polar Express iteration (Amsel et al., 2025): odd quintics from the greedy
    minimax schedule for singular values in ``[1e-3, 1]`` (derived in
    :mod:`equiopt.linalg.coefficients`), by default in bfloat16 as Muon runs it wherever
    the device multiplies bfloat16 natively (:func:`default_dtype`), else in float32.
``"newton_schulz"``
    Muon's tuned quintic Newton-Schulz iteration (default precision as Polar Express).
``"newton_schulz_torch"``
    The same iteration normalised as ``torch.optim.Muon`` does it (and K. Jordan's
    reference code): the input is cast to the iteration dtype first and divided by its
    Frobenius norm computed in that dtype, ``max(norm, 1e-7)``, without the 1 % margin the
    other methods add. Muon's quintic does not converge to 1, so its output depends on
    the input's scale: the margin alone moves the update by about 1 %. With this method
    the spectral rule reproduces ``torch.optim.Muon`` (equal iterates in bfloat16, its
    default precision on every device, as torch's), with
    ``lr_scale="spectral"`` for its ``adjust_lr_fn="original"`` (the default) and
    ``lr_scale="match_adamw"`` for ``"match_rms_adamw"``.
``"gram_newton_schulz"``
    The same quintic steps carried out on the small Gram matrix: for ``X`` with
    ``m <= n`` rows every iterate is ``Q_k X_0`` with ``Q_k`` a polynomial in
    ``G_0 = X_0 X_0^T``, so the loop updates ``Q <- h(G) Q`` and ``G <- h(G) G h(G)`` in
    ``m x m`` products and touches the ``m x n`` matrix only to form ``G_0`` and the
    result. Rounding makes ``G`` drift from the Gram of ``Q X_0``; every
    ``restart_every`` steps the iterate ``X = Q X_0`` is formed and its Gram recomputed,
    which resets the drift (float32 by default; bfloat16 on request).
``"exact"``
    Thin SVD in float64: ``U V^T`` over the singular values above the numerical rank
    threshold of the input's precision.

Wide or tall inputs are handled on the side with the smaller Gram matrix (a tall ``X``
is transposed, iterated, and transposed back), as Muon implementations do.

A bfloat16 iteration on a CPU without bfloat16 hardware (:func:`emulates_bfloat16`) holds
its bfloat16 values in float32 and rounds each product back to bfloat16: the arithmetic
of bfloat16 hardware (exact products, float32 sums, one rounding) at float32's speed.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .coefficients import MUON_NS_COEFFICIENTS, schedule
from .device_choices import decides_like
from .products import Bfloat16ProductsInFloat32

POLAR_METHODS = ("polar_express", "newton_schulz", "newton_schulz_torch", "gram_newton_schulz", "exact")

# Polar Express design interval and safety (Amsel et al. use l = 1e-3 and a 1% margin
# on the upper end for bfloat16 rounding).
POLAR_LOWER = 1e-3
POLAR_SAFETY = 1.01
# Frobenius normalisation margin and floor (a zero matrix stays zero).
NORM_MARGIN = 1.01
NORM_FLOOR = 1e-7
# ``"newton_schulz_torch"``: the norm's lower clamp (torch.optim.Muon's default ``eps``).
TORCH_NORM_EPS = 1e-7
# ``"gram_newton_schulz"``: steps between recomputing the iterate and its Gram.
RESTART_EVERY = 2
# The quintic iterations run over a batch in chunks of at most this many bytes of iterate:
# a step holds the result, one spare chunk and a chunk's two Grams, not two iterates of the
# whole batch. A chunk this size keeps every product far longer than its launch (a
# 1024-wide chunk is over 200 GFLOP a product); smaller chunks cost launches for memory
# (results/roofline has both).
CHUNK_BYTES = 256 * 2**20


def _cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (oneDNN's bfloat16 kernels:
    AVX-512 with BF16 or AMX). Elsewhere torch emulates them, one matrix at a time, many
    times slower than its float32 products (results/engine.md has the figures)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


#: Read once (a constant inside compiled code).
CPU_BFLOAT16 = _cpu_multiplies_bfloat16()


def emulates_bfloat16(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a bfloat16 iteration on ``device`` runs its products as float32 products of
    the bfloat16 operands, each rounded to bfloat16: on CPUs without bfloat16 hardware
    (:data:`CPU_BFLOAT16` False), where torch's bfloat16 kernels are many times slower than its
    float32 ones (results/engine.md). The arithmetic is bfloat16 hardware's: a product of two bfloat16 values is
    exact in float32, the sums accumulate in float32 and the result is rounded once; only
    the order of the sums may differ, as between any two BLAS libraries."""
    return dtype == torch.bfloat16 and decides_like(device) == "cpu" and not CPU_BFLOAT16


def bfloat16_products(device: torch.device) -> contextlib.AbstractContextManager:
    """The context in which code that is not equiopt's (``torch.optim.Muon``) multiplies
    bfloat16 matrices on ``device`` as equiopt's own iterations do: float32 products
    rounded to bfloat16 where :func:`emulates_bfloat16`
    (:class:`~equiopt.linalg.products.Bfloat16ProductsInFloat32`), torch's kernels else."""
    if emulates_bfloat16(torch.bfloat16, device):
        return Bfloat16ProductsInFloat32()
    return contextlib.nullcontext()


def _to_bfloat16_values(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), in float32. Compiled, as
    integer operations on the bits (torch's own rounding formula), since Inductor drops a
    float32 -> bfloat16 -> float32 round trip inside a fused kernel; the inputs are finite."""
    if torch.compiler.is_compiling():
        bits = x.view(torch.int32)
        return ((bits + ((bits >> 16) & 1) + 0x7FFF) & -65536).view(torch.float32)
    return x.bfloat16().float()


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def default_dtype(method: str, device: torch.device) -> torch.dtype:
    """The iteration precision of ``method`` when none is given: float32 for
    ``"gram_newton_schulz"`` (its Gram drifts in bfloat16); bfloat16 for
    ``"newton_schulz_torch"`` (``torch.optim.Muon``'s own precision, everywhere); for
    ``"polar_express"`` and ``"newton_schulz"`` bfloat16 where the device multiplies it
    natively (any device but a CPU, and CPUs with bfloat16 hardware, :data:`CPU_BFLOAT16`),
    float32 on other CPUs, where it is both faster (results/engine.md) and exact to
    float32's rounding instead of bfloat16's."""
    if method == "gram_newton_schulz":
        return torch.float32
    if method == "newton_schulz_torch" or decides_like(device) != "cpu" or CPU_BFLOAT16:
        return torch.bfloat16
    return torch.float32


def _coefficients(method: str, steps: int):
    if method == "newton_schulz":
        return (MUON_NS_COEFFICIENTS,) * steps
    return schedule(POLAR_LOWER, steps, 1.0, POLAR_SAFETY)


def polar(
    X: torch.Tensor,
    method: str = "polar_express",
    steps: int = 5,
    dtype: torch.dtype | None = None,
    restart_every: int = RESTART_EVERY,
    reducer=None,
    narrow: bool = False,
    out: torch.Tensor | None = None,
    row: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    sq_norm: torch.Tensor | None = None,
    finite: torch.Tensor | None = None,
) -> torch.Tensor:
    """Approximate orthogonal polar factor of ``X`` (shape ``(..., m, n)``), in ``X``'s dtype
    (``narrow``: in the iteration's, where that is narrower).

    ``dtype`` is the iteration's precision (default :func:`default_dtype`: bfloat16 for
    ``"newton_schulz_torch"`` and, where the device multiplies bfloat16 natively, for
    ``"polar_express"`` and ``"newton_schulz"``; float32 otherwise).

    Args:
        X: matrices ``(..., m, n)``, batched over the leading dimensions.
        method: one of :data:`POLAR_METHODS`: ``"polar_express"`` (default),
            ``"newton_schulz"`` (Muon's quintic), ``"newton_schulz_torch"`` (normalised
            as ``torch.optim.Muon``), ``"gram_newton_schulz"`` or ``"exact"`` (SVD in
            float64).
        steps: iterations (ignored by ``"exact"``).
        dtype: the iteration's precision; None for the method's default.
        restart_every: for ``"gram_newton_schulz"``, how many steps between recomputing
            the iterate and its Gram.
        reducer: for ``"gram_newton_schulz"`` on a tall matrix split by rows across
            ranks (``X`` is this rank's rows): the :class:`equiopt.maps.RowReducer` that
            sums over them. The ``n x n`` Gram is all-reduced once and once per restart
            (its trace gives the Frobenius norm), the iteration runs on it locally, and
            the result is this rank's rows of the polar factor of the whole matrix.
        narrow: return the last iterate in the iteration's dtype, not cast back to ``X``'s:
            a caller that reads it once (scaling it into a wider update) saves a pass.
        out: the place of the narrow result, made by :func:`empty_factor` (the quintic
            iterations write their last iterate there); implies ``narrow``.
        row: ``(..., m, 1)`` factors: the polar factor of ``Diag(row) X``, which the quintic
            iterations form a chunk at a time as they normalise it (never whole).
        shift: ``(..., 1, n)``: the polar factor of ``Diag(row) X - 1 shift^T`` (a centred
            row stage), formed the same way; its Frobenius norm is summed a block of rows
            at a time.
        sq_norm: ``(..., 1, 1)``: each matrix's squared Frobenius norm where it is known
            (the normalisation before the iterations then reads ``X`` no more for it): of
            ``X``, or with ``row`` of ``Diag(row) X``; not with ``shift``.
        finite: ``(N,)`` bool for the ``N`` matrices of ``X`` (its leading dimensions
            flattened): each is set to whether that matrix's factor is free of NaN and Inf.
            The quintic iterations read it from the diagonal of their last small factor
            ``b G + c G^2``: a normalised iterate stays bounded, so only a NaN or Inf
            carried from the input makes the result non-finite, and one in a row of the
            iterate reaches that row's diagonal entry of every later Gram and small factor
            (no pass over the result); the other methods sum the result.

    Returns:
        ``U V^T`` for ``X = U S V^T``, approximately, of ``X``'s shape (and dtype, unless
        ``narrow``).

    Raises:
        ValueError: for an unknown method, ``steps < 1`` or fewer than two dimensions.
    """
    if finite is not None and method in _QUINTIC and reducer is None:
        return _polar(X, method, steps, dtype, restart_every, reducer, narrow, out, row, shift, sq_norm, finite)
    result = _polar(X, method, steps, dtype, restart_every, reducer, narrow, out, row, shift, sq_norm, None)
    if finite is not None:
        finite.copy_(_finite_sums(result.reshape(-1, *result.shape[-2:])))
    return result


#: The methods whose iterations report each factor's finiteness from their small factors.
_QUINTIC = ("polar_express", "newton_schulz", "newton_schulz_torch")


def _finite_sums(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(N,)``: whether each of the ``N`` matrices of ``t`` is free of NaN and Inf (a sum
    carries any; ``s - s`` is 0 exactly where ``s`` is finite), written into ``out`` if given."""
    s = t.sum(dim=(-2, -1), dtype=torch.float32)
    return torch.eq(s - s, 0, out=out) if out is not None else (s - s) == 0


def _polar(
    X: torch.Tensor,
    method: str,
    steps: int,
    dtype: torch.dtype | None,
    restart_every: int,
    reducer,
    narrow: bool,
    out: torch.Tensor | None,
    row: torch.Tensor | None,
    shift: torch.Tensor | None,
    sq_norm: torch.Tensor | None,
    finite: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`polar`; ``finite`` given only for a quintic method without ``reducer``."""
    if method not in POLAR_METHODS:
        raise ValueError(f"unknown polar method {method!r}; valid: {', '.join(POLAR_METHODS)}")
    if X.ndim < 2:
        raise ValueError(f"polar expects matrices (..., m, n), got shape {tuple(X.shape)}")
    if steps < 1 and method != "exact":
        raise ValueError(f"steps must be >= 1, got {steps}")
    out_dtype = X.dtype
    if (row is not None or shift is not None) and method not in ("polar_express", "newton_schulz"):
        X = X if row is None else X * row
        X, row, shift = (X if shift is None else X - shift), None, None
    if out is not None:
        want = _factor_dtype(X, method, dtype)
        tall = X.shape[-2] > X.shape[-1]
        if out.shape != X.shape or out.dtype != want or not (out.mT if tall else out).is_contiguous():
            raise ValueError(
                f"polar's out must be laid out as empty_factor makes it: {want} of shape {tuple(X.shape)}"
                f"{', the transpose of a contiguous tensor' if tall else ', contiguous'}; "
                f"got {out.dtype} of shape {tuple(out.shape)}, strides {out.stride()}"
            )
        if method in ("exact", "gram_newton_schulz") or reducer is not None:
            return out.copy_(polar(X, method, steps, dtype, restart_every, reducer, narrow=True))
    if method == "exact":
        u, sv, vh = torch.linalg.svd(X.to(torch.float64), full_matrices=False)
        # Singular values below the numerical rank threshold of the input's precision
        # (max(m, n) eps sigma_max, as torch.linalg.matrix_rank) map to 0, so a zero or
        # rank-deficient momentum (an expert that saw few tokens) gets the polar factor
        # of its range only, not rounding noise blown up to unit singular values.
        eps = torch.finfo(X.dtype if X.is_floating_point() else torch.float64).eps
        tol = sv.amax(dim=-1, keepdim=True) * max(X.shape[-2:]) * eps
        return ((u * (sv > tol).to(u.dtype).unsqueeze(-2)) @ vh).to(out_dtype)
    if dtype is None:
        dtype = default_dtype(method, X.device)
    if reducer is not None:
        if method != "gram_newton_schulz":
            raise ValueError(f"a row-split polar factor needs method 'gram_newton_schulz', got {method!r}")
        return _split_gram_iterate(X.mT, _coefficients("polar_express", steps), restart_every, dtype, reducer)
    tall = X.shape[-2] > X.shape[-1]
    x = X.mT if tall else X
    # bfloat16 values held in float32, each result rounded to bfloat16 as a bfloat16 kernel would
    emulated = method != "gram_newton_schulz" and emulates_bfloat16(dtype, X.device)
    rounded = _to_bfloat16_values if emulated else _unchanged
    coeffs = _coefficients(
        "newton_schulz" if method in ("newton_schulz", "newton_schulz_torch") else "polar_express", steps
    )
    if method == "newton_schulz_torch":
        x = rounded(x.float()) if emulated else x.to(dtype)
        x = rounded(x / rounded(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)).clamp_min(TORCH_NORM_EPS))
        place = None if out is None else (out.mT if tall else out).reshape(-1, *x.shape[-2:])
        batch = x.reshape(-1, *x.shape[-2:])
        x = _iterate(batch, None, coeffs, dtype, x.dtype, rounded, place, finite=finite).reshape(x.shape)
    else:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # float64 stays float64
        offset = None
        if row is None and shift is None:
            fro = torch.linalg.matrix_norm(wide, keepdim=True) if sq_norm is None else sq_norm.to(wide.dtype).sqrt()
            scale = NORM_MARGIN * fro + NORM_FLOOR
        else:
            # the division by scale / r scales the rows; the shift over scale is subtracted
            r = None if row is None else (row.mT if tall else row).to(wide.dtype)
            if shift is None and sq_norm is not None:  # ||Diag(r) X||_F^2, known
                fro = sq_norm.to(wide.dtype).sqrt()
            elif shift is None:  # ||Diag(r) X||_F from X's row norms
                norms = torch.linalg.vector_norm(wide, dim=-2 if tall else -1, keepdim=True)
                fro = (norms * r).square().sum(dim=(-2, -1), keepdim=True).sqrt()
            else:
                fro = _stage_norm(wide.mT if tall else wide, row, shift)
            base = NORM_MARGIN * fro + NORM_FLOOR
            scale = base if r is None else base / r
            if shift is not None:
                offset = (shift.mT if tall else shift).to(wide.dtype) / base
        if method == "gram_newton_schulz":
            x = _gram_iterate(_scaled_cast(wide, scale, dtype), coeffs, restart_every)
        else:
            flat = (-1, *wide.shape[-2:])
            held = torch.float32 if emulated else dtype
            place = None if out is None else (out.mT if tall else out).reshape(flat)
            divisor = scale.expand(*wide.shape[:-2], *scale.shape[-2:]).reshape(-1, *scale.shape[-2:])
            if offset is not None:
                offset = offset.expand(*wide.shape[:-2], *offset.shape[-2:]).reshape(-1, *offset.shape[-2:])
            x = _iterate(wide.reshape(flat), divisor, coeffs, dtype, held, rounded, place, offset, finite)
            x = x.reshape(wide.shape)
    x = x.mT if tall else x
    if out is not None:
        return out
    return x if narrow and x.dtype.itemsize <= out_dtype.itemsize else x.to(out_dtype)


def _factor_dtype(X: torch.Tensor, method: str, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of ``polar(X, method, dtype=dtype, narrow=True)``'s result."""
    if method == "exact":
        return X.dtype
    if dtype is None:
        dtype = default_dtype(method, X.device)
    if method != "gram_newton_schulz" and emulates_bfloat16(dtype, X.device):
        dtype = torch.float32
    return X.dtype if dtype.itemsize > X.dtype.itemsize else dtype


def empty_factor(X: torch.Tensor, method: str = "polar_express", dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor of ``X``'s shape in the dtype and layout of ``polar(X, method,
    dtype=dtype, narrow=True)``'s result (a tall ``X``'s factor is the transpose of a
    contiguous iterate): the ``out`` a caller fills a chunk of a batch at a time."""
    dtype = _factor_dtype(X, method, dtype)
    if X.shape[-2] > X.shape[-1]:
        return torch.empty((*X.shape[:-2], X.shape[-1], X.shape[-2]), dtype=dtype, device=X.device).mT
    return torch.empty(X.shape, dtype=dtype, device=X.device)


def chunks(batch: int, matrix_bytes: int) -> list[slice]:
    """Slices of a batch of ``batch`` matrices of ``matrix_bytes`` each, at most
    :data:`CHUNK_BYTES` a slice (at least one matrix)."""
    size = max(1, min(batch, CHUNK_BYTES // max(matrix_bytes, 1)))
    count = -(-batch // size)
    size = -(-batch // count)  # slices of equal size, the last one shorter
    return [slice(i, min(i + size, batch)) for i in range(0, batch, size)]


def _iterate(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    coeffs,
    dtype: torch.dtype,
    held: torch.dtype,
    rounded,
    out: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    finite: torch.Tensor | None = None,
) -> torch.Tensor:
    """The quintic iteration on the matrices ``x`` (``(batch, m, n)``, ``m <= n``), one
    chunk of the batch at a time (:func:`chunks`), each chunk's last iterate written into
    its slice of the result: the step holds the result and one chunk's iterates, not the
    whole batch's twice. ``scale``: ``x`` is the wide input, each matrix divided by its
    entry of ``scale`` and cast to ``dtype`` a chunk at a time (None: ``x`` is the
    normalised iterate already). ``dtype``: the iteration's precision; ``held``: the dtype
    its values are held in (float32 where bfloat16 is emulated, ``rounded`` then rounds);
    ``out``: the result's place (else one is made); ``offset``: subtracted from each
    quotient as it is cast (a centred row stage's shift over its scale); ``finite``: each
    matrix's flag, from its last small factor (see :func:`polar`)."""
    parts = chunks(x.shape[0], x[0].numel() * held.itemsize)
    # one chunk: its last iterate is the result (no buffer held from the start)
    if out is None and len(parts) > 1:
        out = torch.empty(x.shape, dtype=held, device=x.device)
    # with a place for the result, the iterates alternate between a chunk's slice of it and
    # one spare chunk, the last landing in the result: one chunk's iterate beside the result
    spare = (
        None
        if out is None
        else torch.empty((parts[0].stop - parts[0].start, *x.shape[1:]), dtype=held, device=x.device)
    )
    # In float32 and wider ``a`` joins the small factor: ``(a I + b G + c G^2) x`` is one
    # product, with no pass over ``x`` to scale it. In bfloat16 the diagonal sum would be
    # rounded before it multiplies ``x``, so ``a x`` stays a term of its own there.
    fold = torch.finfo(dtype).bits >= 32
    steps = len(coeffs)
    for part in parts:
        places = None if out is None or spare is None else (out[part], spare[: part.stop - part.start])

        def into(k: int) -> dict:
            """Where the ``k``-th iterate goes: the result's slice if ``steps - k`` is even."""
            return {} if places is None else {"out": places[(steps - k) % 2]}

        if scale is None:
            y = x[part]
        else:
            shifted = None if offset is None else offset[part]
            y = _scaled_cast(x[part], scale[part], dtype, rounded, shift=shifted, **into(0))
        for k, (a, b, c) in enumerate(coeffs, start=1):
            # y <- a y + (b G + c G^2) y with G = y y^T, as two fused multiply-adds
            g = rounded(torch.bmm(y, y.mT))
            h = rounded(torch.baddbmm(g, g, g, beta=b, alpha=c))
            del g  # (a chunk holds at most two Grams, and one beside two iterates)
            if finite is not None and k == steps:
                # what is not finite in a row of y is in G's diagonal entry of that row, and so in
                # h's (b, c != 0): the diagonal says it (y is bounded: nothing else overflows)
                _finite_sums(h.diagonal(dim1=-2, dim2=-1).unsqueeze(-1), out=finite[part])
            if fold:
                h.diagonal(dim1=-2, dim2=-1).add_(a)
                y = torch.bmm(h, y, **into(k))
            else:
                y = torch.baddbmm(y, h, y, beta=a, **into(k))
            del h
            if rounded is not _unchanged:
                y = y.copy_(rounded(y)) if places is not None else rounded(y)
    return y if out is None else out


def _scaled_cast(
    wide: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    rounded=None,
    out: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(wide / scale).to(dtype)`` in one pass where ``dtype`` is narrower (the quotient
    rounded in ``wide``'s dtype, then to ``dtype``, as the two operators round it);
    ``rounded``: a bfloat16 iteration emulated in float32 (:func:`emulates_bfloat16`), the
    quotient rounded to bfloat16 values; ``out``: where it goes (else a new tensor);
    ``shift``: ``wide / scale - shift`` in the same pass."""
    emulated = rounded is not None and rounded is not _unchanged
    if emulated or dtype == wide.dtype or torch.compiler.is_compiling():
        q = wide / scale if shift is None else torch.addcdiv(-shift, wide, scale)
        y = rounded(q.float()) if emulated else q.to(dtype)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(wide.shape, dtype=dtype, device=wide.device)
    if shift is None:
        return torch.div(wide, scale, out=out)
    return torch.addcdiv(-shift, wide, scale, out=out)


def _stage_norm(w: torch.Tensor, row: torch.Tensor | None, shift: torch.Tensor) -> torch.Tensor:
    """``||Diag(row) w - 1 shift^T||_F`` of each matrix, ``(..., 1, 1)``, a block of rows
    at a time (:func:`chunks`): the exact sum of squares, not a difference of sums."""
    total = None
    lead = math.prod(w.shape[:-2])
    shift = shift.to(w.dtype)
    for block in chunks(w.shape[-2], lead * w.shape[-1] * w.element_size()):
        part = w[..., block, :]
        z = part - shift if row is None else torch.addcmul(-shift, part, row[..., block, :].to(w.dtype))
        sq = torch.linalg.vector_norm(z, dim=(-2, -1), keepdim=True).square()
        total = sq if total is None else total.add_(sq)
        del z
    assert total is not None
    return total.sqrt()


def _split_gram_iterate(x: torch.Tensor, coeffs, restart_every: int, dtype: torch.dtype, reducer) -> torch.Tensor:
    """:func:`_gram_iterate` of the wide ``x`` (``n x m``, the transpose of a tall matrix)
    whose columns are split across ranks: every Gram ``x x^T`` is a sum over the columns,
    completed by ``reducer``; returns this rank's rows of the polar factor, ``(Q x)^T``."""
    take = getattr(reducer, "take", None)  # replicas of the same rows each sum a slice of them

    def gram(x0: torch.Tensor) -> torch.Tensor:
        part = x0 if take is None else take(x0, -1)
        return reducer.sum(part @ part.mT)

    wide = x.to(torch.promote_types(dtype, torch.float32))
    raw = gram(wide)
    norm = raw.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(0).sqrt()[..., None, None]
    scale = NORM_MARGIN * norm + NORM_FLOOR
    x0 = (wide / scale).to(dtype)
    return _gram_iterate(x0, coeffs, restart_every, gram, (raw / scale.square()).to(dtype)).mT.to(x.dtype)


def _local_gram(x: torch.Tensor) -> torch.Tensor:
    return x @ x.mT


def _gram_iterate(x0: torch.Tensor, coeffs, restart_every: int, gram=_local_gram, g=None) -> torch.Tensor:
    """The Gram Newton-Schulz loop on ``x0`` (``m <= n``): ``gram(x)`` forms a Gram (summed
    over shards for a split ``x0``), ``g`` is ``x0``'s when the caller already has it."""
    eye = torch.eye(x0.shape[-2], dtype=x0.dtype, device=x0.device)
    q = None
    g = gram(x0) if g is None else g
    for k, (a, b, c) in enumerate(coeffs):
        if q is not None and restart_every > 0 and k % restart_every == 0:
            x0, q = q @ x0, None
            g = gram(x0)
        h = a * eye + b * g + c * (g @ g)
        q = h if q is None else h @ q
        if k + 1 < len(coeffs):  # the last step's Gram is never read
            g = h @ (g @ h)
    return x0 if q is None else q @ x0
