"""Matrix products: one operator each (:func:`mm`), and float32 products from bfloat16
tensor-core products (:func:`split`, :func:`split_mm`, :func:`split_gram`).

``a @ b`` on 3-D tensors goes through ``torch.matmul``, which dispatches an expand, a
reshape, the batched product and a view: four operators (each a few microseconds of host
time, eager) for one kernel. The maps and oracles take many small products per step, so
they call :func:`mm`, which goes to ``torch.bmm`` / ``torch.mm`` directly where the
shapes allow and to ``@`` otherwise (same result either way).

**Split products** (``gram_dtype="bfloat16x6"``). A float32 ``x`` is the sum of three
bfloat16 parts, ``x = x1 + x2 + x3`` (``x1`` its top 8 significant bits, ``x2`` the next 8
of ``x - x1``, ``x3 = x - x1 - x2``: 24 significant bits, float32's, see :func:`split`). A product of two such sums,
kept to the terms of order ``2^-16`` and above,

    ``a b ~ a1 b1 + (a1 b2 + a2 b1) + (a1 b3 + a2 b2 + a3 b1)``,

is six bfloat16 products accumulated in float32: what tensor cores run at many times the
rate of strict float32 (on an H100 about 15x per product), with float32's accuracy (the
dropped terms are ``2^-24`` of the product). Two parts (three products) are not enough:
their ``2^-17`` error, amplified by a Gram's condition number, costs 2-8 % of a
right-spectral update at condition number 1e3 where float32 costs 0.2 % (``python -m
equiopt.bench --accuracy``). The terms are summed smallest first. A Gram ``x^T x`` needs
four products (the cross terms are transposes of each other).

A bfloat16 product with a float32 result is one ``out_dtype`` product on CUDA (torch
>= 2.8); elsewhere it is the float32 product of the parts themselves, which is exact in
each term (a product of two 8-bit significands fits float32's 24) and accumulates in
float32: the same arithmetic, so CPU tests check the accuracy a GPU gets.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .device_choices import decides_like

__all__ = [
    "mm",
    "split",
    "split_mm",
    "split_gram",
    "split_times",
    "wide_product",
    "SPLIT_PARTS",
    "Bfloat16ProductsInFloat32",
]

SPLIT_PARTS = 3

# torch.mm / torch.bmm with out_dtype: bfloat16 operands, a float32 result (CUDA)
OUT_DTYPE_MM = hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.bmm, "dtype")

# (i, j) of the products a_i b_j kept, smallest first
_TERMS = ((0, 2), (1, 1), (2, 0), (0, 1), (1, 0), (0, 0))


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``: ``torch.bmm`` for 3-D operands of one batch size, ``torch.mm`` for 2-D ones."""
    if a.ndim == 3 and b.ndim == 3 and a.shape[0] == b.shape[0]:
        return torch.bmm(a, b)
    if a.ndim == 2 and b.ndim == 2:
        return torch.mm(a, b)
    return a @ b


def wide_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bfloat16 operands, accumulated and returned in float32."""
    if decides_like(a) == "cuda" and OUT_DTYPE_MM and a.ndim == b.ndim and a.ndim in (2, 3):
        if a.ndim == 2:
            return torch.mm(a, b, out_dtype=torch.float32)
        if a.shape[0] == b.shape[0]:
            return torch.bmm(a, b, out_dtype=torch.float32)
    return mm(a.float(), b.float())


_PRODUCTS = (
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.baddbmm.default,
)


class Bfloat16ProductsInFloat32(TorchDispatchMode):
    """Inside it, a matrix product (``mm``, ``bmm``, ``addmm``, ``baddbmm``) whose tensors are
    all bfloat16 on the CPU runs as the float32 product of the same values, rounded once to
    bfloat16: what bfloat16 hardware computes (exact products, float32 sums), at float32's
    speed on a CPU without it, where torch's own bfloat16 kernels are many times slower. Used
    around code that is not ours (``torch.optim.Muon``'s bfloat16 iteration); equiopt's
    own iterations do the same explicitly (:func:`equiopt.linalg.polar.emulates_bfloat16`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if (
            func in _PRODUCTS
            and tensors
            and all(t.dtype == torch.bfloat16 and decides_like(t) == "cpu" for t in tensors)
        ):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*wide, **kwargs).bfloat16()
        return func(*args, **kwargs)


def _top_bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) with its significand cut to bfloat16's 8 bits (the low 16 bits of each
    word cleared): exactly a bfloat16 value, and ``x - _top_bits(x)`` is exact."""
    return (x.view(torch.int32) & -65536).view(torch.float32)


def split(x: torch.Tensor) -> torch.Tensor:
    """The three bfloat16 parts of a float32 ``x`` (``(..., m, n)``), side by side along the
    last axis: ``(..., m, 3 n)``, part ``i`` in columns ``[i n, (i + 1) n)`` (one tensor, so
    a batch of them slices, views and cleans like ``x`` itself).

    Each part is the top 8 significant bits of what the previous ones leave, cut by masking
    (truncation, not rounding), so every step is exact and the three parts sum to ``x``
    exactly (24 bits). Masks, unlike a round trip through bfloat16, survive a compiler: one
    that folds ``x.to(bfloat16).float()`` back into ``x`` would leave parts 2 and 3 zero."""
    n = x.shape[-1]
    out = torch.empty(*x.shape[:-1], SPLIT_PARTS * n, dtype=torch.bfloat16, device=x.device)
    rest = x.contiguous()
    for i in range(SPLIT_PARTS):
        top = _top_bits(rest) if i + 1 < SPLIT_PARTS else rest
        out[..., i * n : (i + 1) * n].copy_(top)
        if i + 1 < SPLIT_PARTS:
            rest = rest - top
    return out


def part(parts: torch.Tensor, i: int) -> torch.Tensor:
    """Part ``i`` of :func:`split`'s ``parts``."""
    n = parts.shape[-1] // SPLIT_PARTS
    return parts[..., i * n : (i + 1) * n]


def split_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32 from the :func:`split` parts ``a`` and ``b`` (six products)."""
    out: torch.Tensor | None = None
    for i, j in _TERMS:
        t = wide_product(part(a, i), part(b, j))
        out = t if out is None else out.add_(t)
    assert out is not None
    return out


def split_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of float32 matrices through bfloat16 products, to float32 accuracy."""
    return split_product(split(a), split(b))


def split_times(parts: torch.Tensor, factor: torch.Tensor, right: bool = True) -> torch.Tensor:
    """``x @ factor`` (or ``factor @ x``) for the :func:`split` parts of ``x`` and a float32
    ``factor`` (the small ``R`` or ``L`` of a one-sided map), in float32."""
    f = split(factor)
    return split_product(parts, f) if right else split_product(f, parts)


def split_gram(parts: torch.Tensor, left: bool = False) -> torch.Tensor:
    """The Gram ``x^T x`` (``left``: ``x x^T``) of the ``x`` whose :func:`split` parts are
    given, in float32: ``x1^T x1 + x2^T x2 + S + S^T`` with ``S = x1^T x2 + x1^T x3``."""
    x1, x2, x3 = (part(parts, i) for i in range(SPLIT_PARTS))

    def gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return wide_product(a, b.mT) if left else wide_product(a.mT, b)

    cross = gram(x1, x3).add_(gram(x1, x2))
    return gram(x2, x2).add_(cross).add_(cross.mT).add_(gram(x1, x1))
