"""The precision of the one-sided maps' products: :func:`gram_precision` picks it from
``gram_dtype`` (:data:`GRAM_DTYPES`), and the bfloat16 products keep float32 accuracy where
a Gram needs it (:func:`low_product`, :func:`low_times`; the split products of
:mod:`equiopt.linalg.products`)."""

from __future__ import annotations

import torch

from ..linalg.device_choices import decides_like
from ..linalg.products import OUT_DTYPE_MM, split

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
