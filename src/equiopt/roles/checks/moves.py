"""How the checks move a weight along a symmetry, as plans ``new()`` that compute the
moved value: the rows of its work matrices permuted (with the map of stored positions
that tells how a bias follows), ``1 a^T`` added to each work matrix, or its leading
(expert) axis permuted."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ...layouts import Layout


def _permute_rows(w: Tensor, perm: Tensor) -> Tensor:
    """Rows (dim -2) of ``w`` reordered: ``out[..., i, :] = w[..., perm[i], :]``.

    ``perm`` of shape ``(n,)`` applies to every matrix; ``(E, n)`` gives each index of
    the leading (expert) axis of ``w`` its own permutation.
    """
    perm = perm.to(w.device)
    if perm.ndim == 1:
        return w.index_select(-2, perm)
    E, n = perm.shape
    index = perm.view(E, *([1] * (w.ndim - 3)), n, 1).expand(w.shape)
    return torch.gather(w, -2, index)


def _work_rows_plan(layout: Layout, p: Tensor, perms, name: str) -> tuple[Callable[[], Tensor], Tensor]:
    """``(new, source map)`` for ``p`` with the rows of its work matrices permuted.

    ``perms``: one permutation for every work tensor, or a list with one per work
    tensor. ``new()`` computes the moved value (to_work_list -> rows -> from_work_list)
    from ``p``'s current value. The source map has ``p``'s shape and holds, for each
    stored position, the flat index of the position its new value comes from (the
    same moves applied to a tensor of positions).
    """
    count = layout.num_blocks
    perm_list = list(perms) if isinstance(perms, (list, tuple)) else [perms] * count

    def move(t: Tensor) -> Tensor:
        works = layout.to_work_list(t, name=name)
        return layout.from_work_list([_permute_rows(w, q) for w, q in zip(works, perm_list)])

    src = move(torch.arange(p.numel()).view(p.shape))
    return (lambda: move(p.detach()).clone()), src


def _shift_plan(layout: Layout, p: Tensor, shifts: list[Tensor], name: str) -> Callable[[], Tensor]:
    """``new()`` adding ``1 a^T`` to each work matrix, ``a`` scaled to the matrix's rms."""

    def new() -> Tensor:
        moved = []
        for w, a in zip(layout.to_work_list(p.detach(), name=name), shifts):
            rms = float(w.float().pow(2).mean().sqrt()) or 1.0
            moved.append(w + (a * rms).to(device=w.device, dtype=w.dtype))
        return layout.from_work_list(moved).clone()

    return new


def _leading_plan(q: Tensor, perm: Tensor) -> Callable[[], Tensor]:
    index = perm.to(q.device)
    return lambda: q.detach().index_select(0, index)
