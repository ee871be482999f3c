"""Numerical equivariance checker for update maps (the paper's Definitions 3.x made testable).

A map ``U`` is equivariant under a group acting by ``D -> g.D`` when ``U(g.D) = g.U(D)``.
:func:`check_equivariance` samples random group elements and random inputs and returns
the worst relative violation, so a compatible map scores at rounding level and an
incompatible one (row normalisation under a left rotation, coordinate-wise Adam under a
right rotation) scores O(1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GROUPS = ("biorthogonal", "lpro", "lpro_t", "router", "router_t", "permutation", "permutation_t")


def random_orthogonal(batch: tuple[int, ...], n: int, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """Haar-distributed orthogonal matrices ``(*batch, n, n)`` (QR of a Gaussian with sign fix).

    Args:
        batch: the leading (batch) shape.
        n: the matrix size.
        generator: the random generator to draw from.
        dtype (torch.dtype): the result's dtype.

    Returns:
        The matrices, ``(*batch, n, n)``.
    """
    g = torch.randn(*batch, n, n, generator=generator, dtype=dtype)
    q, r = torch.linalg.qr(g)
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def random_permutation(batch: tuple[int, ...], n: int, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """Uniform random permutation matrices ``(*batch, n, n)``.

    Args:
        batch: the leading (batch) shape.
        n: the matrix size.
        generator: the random generator to draw from.
        dtype (torch.dtype): the result's dtype.

    Returns:
        The matrices, ``(*batch, n, n)``.
    """
    idx = torch.rand(*batch, n, generator=generator).argsort(dim=-1)
    return torch.nn.functional.one_hot(idx, n).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = torch.linalg.vector_norm(b).clamp_min(torch.finfo(b.dtype).tiny)
    return float(torch.linalg.vector_norm(a - b) / denom)


def check_equivariance(
    fn: Callable[[torch.Tensor], torch.Tensor],
    group: str,
    shape: tuple[int, ...],
    trials: int = 3,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    scale: float = 1.0,
    sample: Callable[[tuple[int, ...], torch.Generator], torch.Tensor] | None = None,
) -> float:
    """Worst relative equivariance error of ``fn`` over ``trials`` random inputs and group elements.

    ``shape`` is ``(..., m, n)``; leading dims form a batch and every matrix gets its own
    group element, so a map whose reductions leak across the batch fails too. Groups
    (``P`` permutation, ``Q, R`` orthogonal, ``1`` the ones vector, ``a, b`` vectors):

    - ``"biorthogonal"``: ``D -> Q D R^T`` (hidden matrices; spectral maps).
    - ``"lpro"``: ``D -> P D R^T`` (embeddings, LM heads, SwiGLU gate/up work matrices).
    - ``"lpro_t"``: ``D -> Q D P^T`` (the same on the transpose, e.g. a down projection).
    - ``"router"``: ``D -> P D + 1 a^T`` with ``U(P D + 1 a^T) = P U(D)`` and horizontality
      ``1^T U(D) = 0``; the error is the larger of the two violations.
    - ``"router_t"``: the transposed version ``D -> D P^T + b 1^T``, ``U(D) 1 = 0``.
    - ``"permutation"`` / ``"permutation_t"``: ``D -> P D`` / ``D -> D P^T`` alone.

    ``sample(shape, generator)`` draws inputs (default Gaussian times ``scale``).

    Args:
        fn: the update map, ``(..., m, n) -> (..., m, n)``.
        group: one of :data:`GROUPS`.
        shape: the input shape ``(..., m, n)``.
        trials: how many random inputs (each with its own group elements).
        dtype: the dtype of inputs and group elements.
        seed: seeds the generator.
        scale: the scale of the default Gaussian inputs.
        sample: draws the inputs instead of the default.

    Returns:
        The worst relative violation over the trials: at rounding level for a map
        compatible with ``group``, O(1) for an incompatible one.

    Raises:
        ValueError: for an unknown group or a shape of fewer than two dimensions.
    """
    if group not in GROUPS:
        raise ValueError(f"unknown group {group!r}; valid: {', '.join(GROUPS)}")
    if len(shape) < 2:
        raise ValueError(f"shape must be (..., m, n), got {tuple(shape)}")
    gen = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    batch = tuple(batch)
    worst = 0.0
    for _ in range(trials):
        if sample is None:
            D = scale * torch.randn(*shape, generator=gen, dtype=dtype)
        else:
            D = sample(tuple(shape), gen).to(dtype)
        U = fn(D)
        if group == "biorthogonal":
            L, Rt = random_orthogonal(batch, m, gen, dtype), random_orthogonal(batch, n, gen, dtype).mT
            err = _rel(fn(L @ D @ Rt), L @ U @ Rt)
        elif group in ("lpro", "lpro_t", "permutation", "permutation_t"):
            transposed = group.endswith("_t")
            perm = random_permutation(batch, n if transposed else m, gen, dtype)
            if group.startswith("lpro"):
                rot = random_orthogonal(batch, m if transposed else n, gen, dtype)
            else:
                rot = torch.eye(m if transposed else n, dtype=dtype)
            L, Rt = (rot, perm.mT) if transposed else (perm, rot.mT)
            err = _rel(fn(L @ D @ Rt), L @ U @ Rt)
        else:
            transposed = group == "router_t"
            if transposed:
                P = random_permutation(batch, n, gen, dtype)
                shift = torch.randn(*batch, m, 1, generator=gen, dtype=dtype) * D.abs().mean()
                moved, expected = D @ P.mT + shift, U @ P.mT
                horizontal = U.sum(dim=-1)
            else:
                P = random_permutation(batch, m, gen, dtype)
                shift = torch.randn(*batch, 1, n, generator=gen, dtype=dtype) * D.abs().mean()
                moved, expected = P @ D + shift, P @ U
                horizontal = U.sum(dim=-2)
            leak = float(
                torch.linalg.vector_norm(horizontal) / torch.linalg.vector_norm(U).clamp_min(torch.finfo(U.dtype).tiny)
            )
            err = max(_rel(fn(moved), expected), leak)
        worst = max(worst, err)
    return worst
