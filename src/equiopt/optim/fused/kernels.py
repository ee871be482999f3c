"""Triton kernels of the fused stages (:mod:`.ops`' CUDA implementations).

Every kernel runs on a grid of (blocks of a member, members): the first axis may be as
large as CUDA allows (a 151936 x 1024 embedding is 151,936 blocks of 1024), the second
holds the ``B`` members of a stack. Each reads every element of its tensors once and
writes each output element once. Arithmetic is float32 whatever the storage dtype, in the
order of the eager stages (``torch.lerp``'s two-sided formula; a decay rounded to the
weights' dtype before the update is added, as two foreach operators round). With
``TRITON_INTERPRET=1`` set before this module is imported they run on CPU tensors
(``tests/test_fused_kernels.py``).

The stacks are read as contiguous ``(B, n)``; a gradient given as a strided tensor is made
contiguous first. A part's gradients (read where autograd left them) and the weights of
``decay_add_`` are separate tensors: each member's is addressed from the first one's
pointer by an element offset, kept per list of addresses (computed once, then read from
the device: no transfer when a CUDA graph replays)."""

from __future__ import annotations

import struct
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from ..apply import GRAD_LIMIT

__all__ = ["BLOCK", "finite_flags", "momentum_stage", "decay_add_", "factor_add_", "row_add_"]

#: Elements per program.
BLOCK = 1024


@triton.jit
def _flags_kernel(src, starts, bad, n, nblocks, limit, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    m = tl.program_id(1)
    i = b * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(src + tl.load(starts + m) + i, mask=mask, other=0.0).to(tl.float32)
    out = (x != x) | (x < -limit) | (x > limit)  # NaN, or beyond the limit (infinities too)
    tl.store(bad + m.to(tl.int64) * nblocks + b, tl.max(out.to(tl.int32), axis=0))


@triton.jit
def _flags_cols_kernel(src, starts, bad, sums, rows, cols, nblocks, limit, ROWS: tl.constexpr, COLS: tl.constexpr):
    # a block of ROWS whole rows: its bad flag, and its column sums added once per column
    b = tl.program_id(0)
    m = tl.program_id(1)
    r = (b * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    base = src + tl.load(starts + m)
    worst = tl.zeros((ROWS, COLS), dtype=tl.int32)
    for c0 in range(0, cols, COLS):
        c = c0 + tl.arange(0, COLS)
        mask = (r < rows) & (c[None, :] < cols)
        x = tl.load(base + r * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
        worst = tl.maximum(worst, ((x != x) | (x < -limit) | (x > limit)).to(tl.int32))
        x = tl.where((x - x) == 0.0, x, 0.0)  # NaN and Inf summed as 0
        tl.atomic_add(sums + m.to(tl.int64) * cols + c, tl.sum(x, axis=0), mask=c < cols)
    tl.store(bad + m.to(tl.int64) * nblocks + b, tl.max(tl.max(worst, axis=1), axis=0))


@triton.jit
def _lerp(start, end, weight):
    # torch.lerp: from the nearer end, with a fused multiply-add, as its CPU and CUDA kernels compute it
    diff = end - start
    return tl.where(tl.abs(weight) < 0.5, tl.fma(weight, diff, start), tl.fma(-diff, 1.0 - weight, end))


@triton.jit
def _lerp_scalar(start, end, weight, rest):
    # torch.lerp with a scalar weight: ``rest`` is ``1 - weight``, rounded as float32 computes it
    diff = end - start
    return tl.where(tl.abs(weight) < 0.5, tl.fma(weight, diff, start), tl.fma(-diff, rest, end))


@triton.jit
def _momentum_kernel(
    src,
    starts,
    scratch,
    mom,
    weights,
    n,
    beta,
    rest,
    cols,
    ss0,
    ss1,
    ss2,
    sums,
    row_len,
    rows,
    shift,
    shift_cols,
    NESTEROV: tl.constexpr,
    DIRECTION: tl.constexpr,
    SUMS: tl.constexpr,
    WHOLE_ROWS: tl.constexpr,
    RUN: tl.constexpr,
    SHIFT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    m = tl.program_id(1)
    i = b * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    at = m.to(tl.int64) * n + i
    put = m.to(tl.int64) * ss0 + (i // cols).to(tl.int64) * ss1 + (i % cols).to(tl.int64) * ss2  # its place
    g = tl.load(src + tl.load(starts + m) + i, mask=mask, other=0.0).to(tl.float32)
    g = tl.where((g - g) == 0.0, g, 0.0)  # NaN and Inf read as 0 (g - g is 0 exactly where g is finite)
    g = g.to(scratch.dtype.element_ty).to(tl.float32)  # the sanitised gradient as stored in the buffer
    if SHIFT:  # less its column's shift, what is not finite after it read as 0
        g = (g - tl.load(shift + m.to(tl.int64) * shift_cols + i % shift_cols, mask=mask, other=0.0)).to(
            scratch.dtype.element_ty
        )
        g = tl.where((g - g) == 0.0, g, 0.0).to(tl.float32)
    old = tl.load(mom + at, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weights + m)
    new = _lerp(old, g, w).to(mom.dtype.element_ty)
    tl.store(mom + at, new, mask=mask)
    written = new.to(tl.float32)  # the direction as the map will read it
    if DIRECTION:
        if NESTEROV:
            direction = _lerp_scalar(g, new.to(tl.float32), beta, rest)
        else:
            direction = new.to(tl.float32)
        stored = direction.to(scratch.dtype.element_ty)
        tl.store(scratch + put, stored, mask=mask)
        written = stored.to(tl.float32)
    if SUMS:  # the sums of squares of the rows (entry i in row (i // row_len) % rows), as the direction is written
        sq = tl.where(mask, written * written, 0.0)
        if WHOLE_ROWS:  # every block lies within one row: one atomic add per block
            row = ((b * BLOCK) // row_len) % rows
            tl.atomic_add(sums + m.to(tl.int64) * rows + row, tl.sum(sq, axis=0))
        elif RUN > 0:  # a block holds whole rows of RUN entries: one atomic add per row
            part = tl.sum(tl.reshape(sq, (BLOCK // RUN, RUN)), axis=1)
            row = ((b * BLOCK) // RUN + tl.arange(0, BLOCK // RUN)) % rows
            tl.atomic_add(sums + m.to(tl.int64) * rows + row, part)
        else:
            tl.atomic_add(sums + m.to(tl.int64) * rows + (i // row_len) % rows, sq, mask=mask)


@triton.jit
def _decay_add(where, mask, u, factor, DECAY: tl.constexpr):
    # W <- f W + u (f read from the pointer ``factor``), the decay rounded to the weights'
    # dtype first, as two foreach operators round it
    w = tl.load(where, mask=mask, other=0.0)
    if DECAY:
        w = (w.to(tl.float32) * tl.load(factor)).to(where.dtype.element_ty)
    tl.store(where, (w.to(tl.float32) + u).to(where.dtype.element_ty), mask=mask)


@triton.jit
def _decay_add_kernel(base, offsets, upd, factors, n, DECAY: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    m = tl.program_id(1)
    i = b * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    u = tl.load(upd + m.to(tl.int64) * n + i, mask=mask, other=0.0).to(tl.float32)
    _decay_add(base + tl.load(offsets + m) + i, mask, u, factors + m, DECAY)


@triton.jit
def _factor_add_kernel(
    base,
    offsets,
    x,
    scales,
    factors,
    n,
    rows,
    cols,
    per,
    xs0,
    xs1,
    xs2,
    ws0,
    ws1,
    ws2,
    DECAY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    m = tl.program_id(1)
    j = b * BLOCK + tl.arange(0, BLOCK)
    mask = j < n
    size = rows * cols
    h = j // size  # the member's work matrix, then its row and column
    r = (j % size) // cols
    c = j % cols
    matrix = m * per + h
    at = matrix.to(tl.int64) * xs0 + r.to(tl.int64) * xs1 + c.to(tl.int64) * xs2
    u = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.where((u - u) == 0.0, u, 0.0)  # NaN and Inf read as 0
    u = u * tl.load(scales + matrix, mask=mask, other=0.0)  # the update as the unfused stage rounds it
    where = base + tl.load(offsets + m) + h.to(tl.int64) * ws0 + r.to(tl.int64) * ws1 + c.to(tl.int64) * ws2
    _decay_add(where, mask, u, factors + m, DECAY)


@triton.jit
def _row_add_kernel(
    w,
    x,
    row,
    shift,
    n,
    rows,
    cols,
    ws0,
    ws1,
    ws2,
    xs0,
    xs1,
    xs2,
    SHIFT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < n
    size = rows * cols
    h = j // size  # the matrix, then its row and column
    r = (j % size) // cols
    c = j % cols
    u = tl.load(x + h * xs0 + r * xs1 + c * xs2, mask=mask, other=0.0).to(tl.float32)
    u = u * tl.load(row + h * rows + r, mask=mask, other=0.0)
    where = w + h * ws0 + r * ws1 + c * ws2
    v = (tl.load(where, mask=mask, other=0.0).to(tl.float32) + u).to(w.dtype.element_ty)  # (rounded as addcmul_)
    if SHIFT:
        v = (v.to(tl.float32) - tl.load(shift + h * cols + c, mask=mask, other=0.0)).to(w.dtype.element_ty)
    tl.store(where, v, mask=mask)


def _grid(n: int, members: int) -> tuple[int, int]:
    return (triton.cdiv(n, BLOCK), members)


def _members(sources: list[torch.Tensor], members: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(base, starts, n)``: the gradients of ``members`` members, ``sources`` their stack
    (one tensor) or each member's own, as a base tensor and each member's element offset
    from it (read where they are: a member's gradient is not copied unless strided)."""
    if len(sources) == 1:
        x = sources[0].reshape(members, -1).contiguous()
        n = x.shape[1]
        return x, _strided_starts(members, n, x.device), n
    grads = [g if g.is_contiguous() else g.contiguous() for g in sources]
    return grads[0], _offsets(grads), grads[0].numel()


#: Rows and columns of a tile of the column-summing flags kernel.
TILE_ROWS, TILE_COLS = 32, 128


def finite_flags(sources: list[torch.Tensor], members: int, col_sums: torch.Tensor | None = None) -> torch.Tensor:
    """``(members,)`` bool: each gradient (``sources``: their stack or each member's own)
    free of NaN and Inf and within ``GRAD_LIMIT`` (one read of them); with ``col_sums``
    (``(B, n)`` float32), each one's column sums as rows of ``n`` too (tiles of whole rows,
    one atomic add per column a tile)."""
    base, starts, n = _members(sources, members)
    if col_sums is None:
        grid = _grid(n, members)
        bad = torch.empty((members, grid[0]), dtype=torch.int32, device=base.device)
        _flags_kernel[grid](base, starts, bad, n, grid[0], GRAD_LIMIT, BLOCK=BLOCK)
        return bad.amax(dim=1) == 0
    cols = col_sums.shape[1]
    rows = n // cols
    if col_sums.shape != (members, cols) or rows * cols != n or not col_sums.is_contiguous():
        raise ValueError(
            f"finite_flags: col_sums must be ({members}, cols) dividing {n} entries, got {tuple(col_sums.shape)}"
        )
    grid = (triton.cdiv(rows, TILE_ROWS), members)
    bad = torch.empty((members, grid[0]), dtype=torch.int32, device=base.device)
    col_sums.zero_()
    _flags_cols_kernel[grid](
        base, starts, bad, col_sums, rows, cols, grid[0], GRAD_LIMIT, ROWS=TILE_ROWS, COLS=TILE_COLS
    )
    return bad.amax(dim=1) == 0


def momentum_stage(
    sources: list[torch.Tensor],
    scratch: torch.Tensor,
    momentum: torch.Tensor,
    ok: torch.Tensor,
    beta: float,
    nesterov: bool,
    direction: bool = True,
    sums: torch.Tensor | None = None,
    run: int = 0,
    shift: torch.Tensor | None = None,
) -> None:
    """:func:`.ops.momentum_stage` in one kernel (``momentum`` contiguous; ``scratch``
    contiguous, or ``(B, rows, cols)`` strided where the gradients are each member's own);
    with ``sums`` (``(B, rows)`` float32), each row's sum of squares of the direction too
    (with ``run``, entry ``e`` in row ``(e // run) % rows``)."""
    members = momentum.shape[0]
    n = momentum.numel() // members
    base, starts, _ = _members(sources or [scratch], members)
    if scratch.is_contiguous():
        place = scratch.view(members, 1, n)
    elif scratch.dim() == 3 and sources:
        place = scratch
    else:
        raise ValueError(
            "momentum_stage: a strided scratch must be (B, rows, cols) beside the members' own gradients; "
            f"got shape {tuple(scratch.shape)}, strides {scratch.stride()}"
        )
    weights = ok.to(scratch.dtype) * (1.0 - beta)  # as the eager stage rounds them
    rows = 1 if sums is None else sums.shape[1]
    row_len = run or n // rows
    if sums is not None:
        if sums.shape != (members, rows) or n % (rows * row_len) or not sums.is_contiguous():
            raise ValueError(
                f"momentum_stage: sums must be ({members}, rows) dividing {n} entries in runs of {row_len}, "
                f"got {tuple(sums.shape)}"
            )
        sums.zero_()
    _momentum_kernel[_grid(n, members)](
        base,
        starts,
        scratch,
        momentum,
        weights.float(),
        n,
        beta,
        _rest(beta),
        place.shape[-1],
        *place.stride(),
        sums if sums is not None else weights,
        row_len,
        rows,
        shift.float().contiguous() if shift is not None else weights,
        shift.shape[1] if shift is not None else 1,
        NESTEROV=nesterov,
        DIRECTION=direction,
        SUMS=sums is not None,
        WHOLE_ROWS=row_len % BLOCK == 0,
        RUN=row_len if BLOCK % row_len == 0 and row_len < BLOCK else 0,
        SHIFT=shift is not None,
        BLOCK=BLOCK,
    )


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _rest(beta: float) -> float:
    """``1 - beta`` in float32 arithmetic (as a float32 kernel computes it from a float32 ``beta``)."""
    return _float32(1.0 - _float32(beta))  # (exact in double, then rounded once)


#: Offsets kept per list of addresses, the most recently used last (gradients that autograd
#: allocates afresh each step mostly come back at the addresses of the step before); the
#: oldest go beyond :data:`_KEPT`, except those a CUDA graph captured (its replays read them).
_OFFSETS: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_CAPTURED: dict[tuple, torch.Tensor] = {}
_KEPT = 256


def _kept(key: tuple, make) -> torch.Tensor:
    found = _OFFSETS.get(key)
    if found is None:
        found = _OFFSETS[key] = make()
        while len(_OFFSETS) > _KEPT:
            _OFFSETS.popitem(last=False)
    else:
        _OFFSETS.move_to_end(key)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        _CAPTURED[key] = found
    return found


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ``values`` on ``device``, copied without waiting for the device."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _offsets(params: list[torch.Tensor]) -> torch.Tensor:
    """Each member's element offset from the first one's address, on the device (kept)."""
    size, first = params[0].element_size(), params[0].data_ptr()
    return _kept(
        (params[0].device, params[0].dtype, *(p.data_ptr() for p in params)),
        lambda: _to_device([(p.data_ptr() - first) // size for p in params], params[0].device),
    )


def _strided_starts(members: int, n: int, device: torch.device) -> torch.Tensor:
    """The element offsets ``0, n, 2n, ...`` of a stack's members, on the device (kept)."""
    return _kept(("stack", device, members, n), lambda: _to_device([m * n for m in range(members)], device))


def _multipliers(factors: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The decay factors as a foreach multiply of weights of ``dtype`` takes them, in float32."""
    return None if factors is None else factors.to(dtype).float()


def decay_add_(params: list[torch.Tensor], update: torch.Tensor, factors: torch.Tensor | None) -> None:
    """:func:`.ops.decay_add_` in one kernel (contiguous weights and update stack)."""
    members = len(params)
    n = params[0].numel()
    upd = update.reshape(members, n)
    factors = _multipliers(factors, params[0].dtype)
    _decay_add_kernel[_grid(n, members)](
        params[0],
        _offsets(params),
        upd,
        factors if factors is not None else upd,
        n,
        DECAY=factors is not None,
        BLOCK=BLOCK,
    )


def factor_add_(
    params: list[torch.Tensor],
    factor: torch.Tensor,
    scales: torch.Tensor,
    factors: torch.Tensor | None,
    strides: list[int],
) -> None:
    """:func:`.ops.factor_add_` in one kernel (contiguous weights; the factor of any strides)."""
    members = len(params)
    per = factor.shape[0] // members
    rows, cols = factor.shape[-2:]
    n = per * rows * cols
    factors = _multipliers(factors, params[0].dtype)
    k = scales.reshape(-1).float()
    _factor_add_kernel[_grid(n, members)](
        params[0],
        _offsets(params),
        factor,
        k,
        factors if factors is not None else k,
        n,
        rows,
        cols,
        per,
        *factor.stride(),
        *strides,
        DECAY=factors is not None,
        BLOCK=BLOCK,
    )


def row_add_(weight: torch.Tensor, x: torch.Tensor, row: torch.Tensor, shift: torch.Tensor | None) -> None:
    """:func:`.ops.row_add_` in one kernel (weight and ``x`` of any strides, viewed as
    ``(B, m, n)``)."""
    rows, cols = weight.shape[-2:]
    w3 = weight if weight.dim() == 3 else weight.view(-1, rows, cols) if weight.dim() > 3 else weight.unsqueeze(0)
    x3 = x.expand(weight.shape)
    x3 = x3 if x3.dim() == 3 else x3.reshape(-1, rows, cols) if x3.dim() > 3 else x3.unsqueeze(0)
    k = row.expand(*weight.shape[:-1], 1).reshape(-1).float().contiguous()
    t = None if shift is None else shift.expand(*weight.shape[:-2], 1, cols).reshape(-1).float().contiguous()
    n = w3.numel()
    _row_add_kernel[(triton.cdiv(n, BLOCK),)](
        w3,
        x3,
        k,
        t if t is not None else k,
        n,
        rows,
        cols,
        *w3.stride(),
        *x3.stride(),
        SHIFT=t is not None,
        BLOCK=BLOCK,
    )
