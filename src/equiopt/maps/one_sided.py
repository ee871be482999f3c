"""The one-sided spectral maps (Algorithm 1): the damped right-polar map
``nu^alpha D (D^T D + eps I)^(-1/2)`` (:func:`right_spectral`, RightPolarGradM) and the
left-polar map ``nu^alpha (D D^T + eps I)^(-1/2) D`` (:func:`left_spectral`,
LeftPolarGradM), one function of ``D`` computed from the smaller Gram, with their scales
(:data:`SCALES`) and dampings (:data:`DAMPINGS`); :func:`one_sided_factored` in factored
form, on either route of :mod:`equiopt.maps.routes`."""

from __future__ import annotations

import torch

from ..linalg import chunks, empty_factor, inv_sqrt, polar
from ..linalg.products import mm, split_gram
from .base import (
    Factored,
    RowReducer,
    _check,
    _col_mean,
    _compute_dtype,
    _maybe_center,
    _renamed_keyword,
    _sum_then,
    _take,
    materialize,
)
from .precision import _is_split, _low, low_product
from .routes import _DIRECT_METHODS, one_sided_route

SCALES = ("nu", "rms")

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


def _one_sided_input(
    D: torch.Tensor,
    center: bool,
    reducer: RowReducer | None,
    centered_input: bool,
    route: str,
    method: str,
    steps: int,
    gram_dtype: str | None,
) -> tuple[torch.Tensor, str]:
    """The work matrix of a one-sided map or a hybrid and the route of its one-sided stage.

    ``D`` in the compute dtype, centred when ``center`` (used as it is when ``centered_input``),
    and :func:`one_sided_route`'s decision for it: made once per map, and given to
    :func:`_one_sided` (a hybrid's first stage has the work matrix's shape, dtype and
    device, so the decision holds for either stage).
    """
    x = _maybe_center(D.to(_compute_dtype(D)), center, reducer, centered_input)
    return x, one_sided_route(x, route, method, steps, gram_dtype, reducer)


def _one_sided(
    x: torch.Tensor | Factored,
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
    narrow: bool = False,
    rows_of=None,
    stage_sq: torch.Tensor | None = None,
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

    ``route``: the route :func:`one_sided_route` decided (see :func:`_one_sided_input`):
    ``"gram"`` (the above) or ``"direct"`` (the polar factor of ``x`` itself, see
    :func:`_one_sided_polar`, which takes ``x`` as a hybrid's row stage in factored form,
    ``rows_of`` and ``narrow``; the Gram route takes ``x`` whole and ignores them).
    """
    _check_settings(scale, damping)
    if route == "direct" and method != "gram_newton_schulz":
        return _one_sided_polar(
            x, eps, alpha, steps, centered, scale, rows, _DIRECT_METHODS[method], None, narrow, rows_of, stage_sq
        )
    if isinstance(x, Factored):
        x = materialize(x)
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
    x: torch.Tensor | Factored,
    eps: float,
    alpha: float,
    steps: int,
    centered: bool,
    scale: str = "nu",
    rows: torch.Tensor | None = None,
    method: str = "gram_newton_schulz",
    dtype: torch.dtype | None = torch.float32,
    narrow: bool = False,
    rows_of=None,
    stage_sq: torch.Tensor | None = None,
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
    result projected by its row mean.

    ``x``: ``D``, or a hybrid's row stage in factored form (``D = s * x - c``), formed a chunk
    of the batch at a time (:func:`equiopt.linalg.chunks`) as the polar factor is: the map
    holds its result and one chunk's temporaries. ``rows_of(D)``: the ``"rms"`` scale's rows
    of each matrix of a chunk (default ``rows``, or all ``m``). ``narrow``: ``U`` is returned
    in the iteration's dtype, as ``x`` with the scale as a ``(..., 1, 1)`` row factor (the
    caller widens it as it scales it and checks ``U`` itself for non-finite values)."""
    stage = x if isinstance(x, Factored) else Factored(x)
    lead, (m, n) = stage.x.shape[:-2], stage.x.shape[-2:]
    flat = _each(stage, lambda t: t.reshape(-1, *t.shape[-2:]))
    batch = flat.x.shape[0]
    wide = flat.x.dtype
    out = empty_factor(flat.x, method, dtype) if narrow else torch.empty(flat.x.shape, dtype=wide, device=flat.x.device)
    factors = torch.empty(batch, 1, 1, dtype=wide, device=flat.x.device)
    scaled = alpha != 0 or scale != "nu"
    # a row stage (and its shift) is scaled into the iteration as it is normalised: D is
    # never formed ("rms" reads the stage's rows and Frobenius norm from a formed chunk)
    staged = flat.row is not None and scale != "rms"
    shift = None
    for part in chunks(batch, m * n * out.itemsize):
        if staged:
            D, row = flat.x[part], flat.row[part]  # type: ignore[index]
            shift = None if flat.shift is None else flat.shift[part]
        else:
            D, row = materialize(_each(flat, lambda t: t[part])), None
        sq = None if stage_sq is None or not staged or shift is not None else stage_sq.reshape(-1, 1, 1)[part]
        if narrow:
            u = polar(D, method=method, steps=steps, dtype=dtype, out=out[part], row=row, shift=shift, sq_norm=sq)
        else:
            u = polar(D, method=method, steps=steps, dtype=dtype, row=row, shift=shift, sq_norm=sq).to(wide)
        if not scaled:
            if not narrow:
                out[part] = u
            continue
        # nu = tr(U^T D): one dot per matrix, no product matrix; + 0, or NaN where it is not
        # finite (the clamp alone would turn -Inf into eps)
        nu = _dots(u, D, row)
        if shift is not None:  # tr(U^T 1 shift^T): U's column sums against the shift
            nu = nu - (u.sum(dim=-2, keepdim=True, dtype=wide) * shift).sum(dim=-1, keepdim=True)
        nu = nu.clamp_min(eps) + (nu - nu)
        # ||D||_F^2 is read by the "rms" scale only: one reduction over D, no squared copy
        fro2 = torch.linalg.vector_norm(D, dim=(-2, -1), keepdim=True).square() if scale == "rms" else nu
        r: int | torch.Tensor = m
        if rows_of is not None:
            r = rows_of(D).reshape(-1, 1, 1)
        elif rows is not None:
            r = rows.reshape(-1)[part].reshape(-1, 1, 1)
        factors[part] = _scale(nu, fro2, alpha, r, n, centered, eps, scale)
        if not narrow:
            torch.mul(u, factors[part], out=out[part])
    if narrow:
        row = factors.view(*lead, 1, 1) if scaled else None
        mean = out.mean(dim=-2, keepdim=True, dtype=wide).view(*lead, 1, n) if centered else None
        shift = None if mean is None else (mean if row is None else mean * row)
        return Factored(out.view(*lead, m, n) if lead else out[0], row=row, shift=shift)
    u = out.view(*lead, m, n) if lead else out[0]
    return Factored(u, shift=u.mean(dim=-2, keepdim=True) if centered else None)


def _each(f: Factored, fn) -> Factored:
    """``f`` with ``fn`` applied to each of its tensors."""
    return Factored(fn(f.x), *[None if t is None else fn(t) for t in f[1:]])


def _dots(a: torch.Tensor, b: torch.Tensor, row: torch.Tensor | None = None) -> torch.Tensor:
    """``tr(a_k^T Diag(row_k) b_k)`` of each matrix pair of two ``(B, m, n)`` batches (``row``:
    ``(B, m, 1)``, or none), as ``(B, 1, 1)`` in ``b``'s dtype: one matrix-vector product per
    block of rows, ``a`` widened a block of rows at a time (:func:`equiopt.linalg.chunks`)
    and scaled by ``row`` in the same pass; ``b`` is read where it is, no elementwise
    product formed whole."""
    if not b.is_contiguous():
        if b.mT.is_contiguous():
            a, b = a.mT, b.mT
            row = None if row is None else row.mT  # (B, 1, m): a factor per column now
        else:
            b = b.contiguous()
    per_row = row is not None and row.shape[-1] == 1
    total = None
    for block in chunks(b.shape[-2], b.shape[0] * b.shape[-1] * b.element_size()):
        i, j = block.start, block.stop
        x = b[:, i:j]
        if row is None:
            w = a[:, i:j].to(b.dtype, memory_format=torch.contiguous_format)
        else:  # the product widens a as it scales it, into a contiguous block: the cast's one pass
            w = torch.empty(x.shape, dtype=b.dtype, device=b.device)
            torch.mul(a[:, i:j], (row[:, i:j] if per_row else row).to(b.dtype), out=w)
        dot = torch.bmm(w.reshape(b.shape[0], 1, -1), x.reshape(b.shape[0], -1, 1))
        total = dot if total is None else total.add_(dot)
        del x, w  # (one block's temporaries at a time)
    assert total is not None
    return total


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
    narrow: bool = False,
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
        narrow: on the direct route, the polar factor in its iteration's dtype with the
            scale as a row factor (see :func:`_one_sided_polar`).

    Returns:
        The update as a :class:`Factored`.
    """
    x, route = _one_sided_input(D, center, reducer, centered_input, route, method, steps, gram_dtype)
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
        narrow=narrow,
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
