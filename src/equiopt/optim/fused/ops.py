"""The fused stages of a bucket's step as ``torch.library`` custom operators.

Each operator reads each of its tensors once and writes each of its outputs once, so the
roofline (:mod:`equiopt.roofline`), which charges an operator the bytes of its inputs and of
what it writes, counts it as the kernel it runs, and ``torch.compile`` sees one operator:

- ``equiopt::grad_flags``: the finite flags of a part's gradients, stacked or each where
  it is (``(B,)`` bool: free of NaN and Inf and within ``GRAD_LIMIT``, and present), the
  flags a step reports, and the skip counters (one read of the gradients); given
  ``col_sums``, also each finite gradient's column sums (a centred map's column means);
- ``equiopt::momentum_stage``: the gradients sanitised (NaN and Inf read as 0), the
  momentum EMA ``M <- M + ok (1 - beta) (G - M)`` and the direction, Nesterov's
  ``G + beta (M - G)`` or the momentum itself, written into the part's place in the
  bucket's buffer where the map reads it (one read of the gradients, read where autograd
  left them, and of the momentum, one write of the momentum and the direction; no direction
  where the map reads the momentum): a part's gradients are never stacked first;
  given ``sums``, also the sums of squares of the direction's rows or matrices as it writes
  them (a few bytes each), what the map would otherwise read the whole direction again for;
- ``equiopt::decay_add_``: ``W <- f W + U`` for every member (``f = 1 - lr wd ok``, or no
  decay), the update read from one stack (one read of weights and update, one write of
  the weights);
- ``equiopt::factor_add_``: the same with ``U = k X`` formed as it is read, ``X`` a narrow
  map result (Muon's bfloat16 polar factor) in work layout, read as 0 where not finite,
  and ``k`` each work matrix's scale (one read of weights and factor, one write of the
  weights: no update is formed, and the guard does not clean the factor first);
- ``equiopt::row_add_``: ``W <- W + Diag(k) X - 1 t^T`` for a row-scaled map with a column
  shift (a centred row-norm map's update, paper section 3.3), formed as it is read (one read
  of weights and ``X``, one write of the weights, where the unfused stages pass over the
  weights twice).

The CPU implementation of each is the eager code of :mod:`equiopt.optim.buckets` (results
bitwise as before); CUDA's runs the Triton kernels of :mod:`.kernels`. None reads a tensor
back to the host or allocates anything of a gradient's size, so a step keeps every
guarantee of ``docs/step.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..apply import GRAD_LIMIT, finite_flags

__all__ = ["grad_flags", "momentum_stage", "decay_add_", "factor_add_", "row_add_"]


@torch.library.custom_op("equiopt::grad_flags", mutates_args=("counters", "col_sums"))
def grad_flags(
    sources: list[Tensor], counters: Tensor, present: Tensor | None, members: int, col_sums: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(ok, reported)`` of ``members`` gradients, ``sources`` their stack (one tensor) or
    each member's own: ``ok`` is free of NaN and Inf, every entry within ``GRAD_LIMIT`` and
    present (``present``: None where all are); ``reported`` is True except for a present,
    non-finite gradient, counted in ``counters``. ``col_sums`` (``(B, n)`` float32): each
    member's column sums, its entries read as rows of ``n``, summed as they are read (a
    centred map's column means, without a pass of their own); unspecified for a member
    whose flag is False (the step keeps its momentum and refuses its update)."""
    if len(sources) == 1:
        seen = sources[0].reshape(members, -1)
        # two reductions (aminmax along a dimension is many times slower on a CPU); NaN fails both
        finite = (seen.amin(dim=1) >= -GRAD_LIMIT) & (seen.amax(dim=1) <= GRAD_LIMIT)
    else:  # each one's least and largest entries, or its largest magnitude (NaN and Inf fail the bound)
        finite = finite_flags(sources)
    if col_sums is not None:  # (no copy of a gradient: a member that is not finite is skipped anyway)
        for k, g in enumerate(sources[0].reshape(members, -1) if len(sources) == 1 else sources):
            torch.sum(g.reshape(-1, col_sums.shape[1]), dim=0, dtype=torch.float32, out=col_sums[k])
    return _combine(finite, counters, present)


def _combine(finite: Tensor, counters: Tensor, present: Tensor | None) -> tuple[Tensor, Tensor]:
    if present is not None:
        bad = present & ~finite
        ok, reported = finite & present, ~bad
    else:
        ok, bad, reported = finite, ~finite, finite.clone()  # (an operator's outputs may not alias)
    counters.add_(bad)
    return ok, reported


@grad_flags.register_fake
def _(
    sources: list[Tensor], counters: Tensor, present: Tensor | None, members: int, col_sums: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    return sources[0].new_empty((members,), dtype=torch.bool), sources[0].new_empty((members,), dtype=torch.bool)


@grad_flags.register_kernel("cuda")
def _(
    sources: list[Tensor], counters: Tensor, present: Tensor | None, members: int, col_sums: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    from . import kernels

    return _combine(kernels.finite_flags(sources, members, col_sums), counters, present)


@torch.library.custom_op("equiopt::momentum_stage", mutates_args=("scratch", "momentum", "sums"))
def momentum_stage(
    sources: list[Tensor],
    scratch: Tensor,
    momentum: Tensor,
    ok: Tensor,
    beta: float,
    nesterov: bool,
    direction: bool = True,
    sums: Tensor | None = None,
    run: int = 0,
    shift: Tensor | None = None,
) -> None:
    """The gradients sanitised, the momentum EMA with weight ``ok (1 - beta)`` per member (a
    skipped member's momentum stays bit for bit) and the direction into ``scratch``:
    ``lerp(G, M, beta)`` with ``nesterov``, else ``M``. ``scratch`` and ``momentum`` are
    ``(B, ...)`` stacks of one shape (``scratch`` contiguous, or ``(B, rows, cols)`` of any
    strides where the gradients are each member's own); the gradients are ``scratch`` itself
    where ``sources`` is empty, else their stack (one tensor) or each member's own (``B``
    tensors), read where they are. Without ``direction`` (where the caller reads the momentum itself) nothing is
    kept in ``scratch``: the kernel neither writes it nor, given ``sources``, reads it; here
    it serves as the sanitised gradients' workspace. ``sums`` (``(B, k)``): each member's
    direction (the momentum where none is written), its entries in order as ``k`` rows of
    equal length, gets each row's sum of squares; with ``run``, entry ``e`` counts in sum
    ``(e // run) % k`` instead (runs of ``run`` entries, in turn: heads along columns).
    ``shift`` (``(B, n)``): subtracted from each row of ``n`` entries of each member's
    sanitised gradient as it is read (a centred map's column means: the gradient enters a
    momentum kept in the quotient centred), what is not finite after it read as 0."""
    _momentum_stage(sources, scratch, momentum, ok, beta, nesterov, direction, shift)
    if sums is not None:
        d = scratch if direction else momentum
        if run:
            sq = d.reshape(sums.shape[0], -1, sums.shape[1], run).square().sum(dim=(1, 3))
        else:
            sq = torch.linalg.vector_norm(d.reshape(sums.shape[0], sums.shape[1], -1), dim=-1).square()
        sums.copy_(sq)


def _momentum_stage(
    sources: list[Tensor],
    scratch: Tensor,
    momentum: Tensor,
    ok: Tensor,
    beta: float,
    nesterov: bool,
    direction: bool,
    shift: Tensor | None = None,
) -> None:
    if len(sources) == 1:  # copied and sanitised in one pass
        torch.nan_to_num(sources[0], nan=0.0, posinf=0.0, neginf=0.0, out=scratch.view(sources[0].shape))
    else:
        if sources and scratch.is_contiguous():
            torch.stack([g.reshape(-1) for g in sources], out=scratch.view(len(sources), -1))
        elif sources:  # a strided scratch: the direction's place seen in the stored layout
            torch._foreach_copy_(list(scratch.unbind(0)), [g.view(scratch.shape[1:]) for g in sources])
        torch.nan_to_num_(scratch, nan=0.0, posinf=0.0, neginf=0.0)
    if shift is not None:
        rows = scratch.view(shift.shape[0], -1, shift.shape[1])
        torch.nan_to_num_(rows.sub_(shift.to(scratch.dtype).unsqueeze(1)), nan=0.0, posinf=0.0, neginf=0.0)
    weight = ok.to(scratch.dtype) * (1.0 - beta)
    momentum.lerp_(scratch, weight.view(-1, *([1] * (momentum.ndim - 1))))
    if not direction:
        return
    if nesterov:
        scratch.lerp_(momentum, beta)
    else:
        scratch.copy_(momentum)


@momentum_stage.register_fake
def _(
    sources: list[Tensor],
    scratch: Tensor,
    momentum: Tensor,
    ok: Tensor,
    beta: float,
    nesterov: bool,
    direction: bool = True,
    sums: Tensor | None = None,
    run: int = 0,
    shift: Tensor | None = None,
) -> None:
    return None


@momentum_stage.register_kernel("cuda")
def _(
    sources: list[Tensor],
    scratch: Tensor,
    momentum: Tensor,
    ok: Tensor,
    beta: float,
    nesterov: bool,
    direction: bool = True,
    sums: Tensor | None = None,
    run: int = 0,
    shift: Tensor | None = None,
) -> None:
    from . import kernels

    kernels.momentum_stage(sources, scratch, momentum, ok, beta, nesterov, direction, sums, run, shift)


@torch.library.custom_op("equiopt::decay_add_", mutates_args=("params",))
def decay_add_(params: list[Tensor], update: Tensor, factors: Tensor | None) -> None:
    """``params[k] <- factors[k] params[k] + update[k]`` (no multiply where ``factors`` is
    None): the decay and the update add of a part's members, ``update`` their ``(B, ...)``
    stack."""
    if factors is not None:
        torch._foreach_mul_(params, list(torch.unbind(factors, 0)))
    torch._foreach_add_(params, list(update.unbind(0)))


@decay_add_.register_fake
def _(params: list[Tensor], update: Tensor, factors: Tensor | None) -> None:
    return None


@decay_add_.register_kernel("cuda")
def _(params: list[Tensor], update: Tensor, factors: Tensor | None) -> None:
    from . import kernels

    kernels.decay_add_(params, update, factors)


@torch.library.custom_op("equiopt::factor_add_", mutates_args=("params", "place"))
def factor_add_(
    params: list[Tensor],
    factor: Tensor,
    scales: Tensor,
    factors: Tensor | None,
    place: Tensor,
    strides: list[int],
) -> None:
    """``W_b <- f_b W_b + k X`` for every member ``b`` (no multiply where ``factors`` is
    None), an entry of ``X`` that is not finite read as 0: ``factor`` holds the ``B P``
    work matrices ``X`` of the members (``P`` each, in order), ``scales`` their
    ``(B P, 1, 1)`` scales ``k`` (0 for a refused matrix); ``strides`` are the strides of a
    member's weight seen as its ``(P, rows, cols)`` work matrices (a view of the contiguous
    weight). ``place``, of ``factor``'s shape in the weights' dtype, is workspace: its
    contents are undefined afterwards (here the update is formed there, in the order the
    unfused stages round it; the CUDA kernel neither reads nor writes it)."""
    torch.mul(factor, scales, out=place)
    # (a finite entry is scaled as it is; what is not finite is refused, its scale 0)
    torch.nan_to_num_(place, nan=0.0, posinf=0.0, neginf=0.0)
    if factors is not None:
        torch._foreach_mul_(params, list(torch.unbind(factors, 0)))
    per = place.shape[0] // len(params)
    views = [p.as_strided((per, *place.shape[-2:]), strides) for p in params]
    torch._foreach_add_(views, list(place.split(per)))


@factor_add_.register_fake
def _(
    params: list[Tensor],
    factor: Tensor,
    scales: Tensor,
    factors: Tensor | None,
    place: Tensor,
    strides: list[int],
) -> None:
    return None


@factor_add_.register_kernel("cuda")
def _(
    params: list[Tensor],
    factor: Tensor,
    scales: Tensor,
    factors: Tensor | None,
    place: Tensor,
    strides: list[int],
) -> None:
    from . import kernels

    kernels.factor_add_(params, factor, scales, factors, strides)


@torch.library.custom_op("equiopt::row_add_", mutates_args=("weight",))
def row_add_(weight: Tensor, x: Tensor, row: Tensor, shift: Tensor | None) -> None:
    """``weight <- weight + row * x - shift``: ``weight`` and ``x`` of one shape ``(..., m,
    n)`` (any strides), ``row`` its rows' factors ``(..., m, 1)`` and ``shift`` ``(..., 1,
    n)`` or None, both already scaled by the step's coefficient. Rounded as the two
    unfused operators round it: the row-scaled add first, then the shift."""
    weight.addcmul_(x, row)
    if shift is not None:
        weight.sub_(shift)


@row_add_.register_fake
def _(weight: Tensor, x: Tensor, row: Tensor, shift: Tensor | None) -> None:
    return None


@row_add_.register_kernel("cuda")
def _(weight: Tensor, x: Tensor, row: Tensor, shift: Tensor | None) -> None:
    from . import kernels

    kernels.row_add_(weight, x, row, shift)
