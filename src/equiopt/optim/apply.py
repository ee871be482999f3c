"""Applying updates to parameters without host reads (the optimizer's last stage).

Every function here takes the per-parameter *finite flag* ``ok`` (a 0-d tensor, 1 where
the gradient was finite, 0 where it was not) and folds it into the step size, so a
parameter whose gradient had a NaN or Inf keeps its weights and state bit for bit while
no Python branch ever looks at a tensor value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..linalg.device_choices import decides_like
from ..maps import Factored, gemm_, materialize, row_scaled_blocks

INF_NORM = float("inf")

#: Largest gradient entry a step uses (2^50, about 1.1e15). Beyond it float32 squares,
#: row norms and Grams of the momentum (which an EMA keeps within the largest gradient
#: entry seen) could overflow for matrices of up to 2^28 entries, and AdamW's second
#: moment would hold an Inf for good; such a gradient is skipped and counted like a
#: non-finite one, so nothing non-finite reaches the state.
GRAD_LIMIT = 2.0**50


def finite_flags(grads: Sequence[torch.Tensor], limit: float = GRAD_LIMIT) -> torch.Tensor:
    """1-D bool tensor: is each gradient free of NaN and Inf, with every entry at most
    ``limit`` in magnitude?

    One foreach infinity norm over all of them (the largest magnitude: it neither
    overflows, as a sum or a 2-norm of large finite entries would, nor hides a NaN, which
    it propagates as ``torch.nn.utils.clip_grad_norm_``'s non-finite check relies on) and
    one comparison, which a NaN fails: three operators however many gradients. On a CPU a
    large gradient is read by ``aminmax`` instead, the same test in a faster pass there
    (:data:`CPU_MINMAX`). An empty tensor (an empty shard) is finite.
    """
    present = [k for k, g in enumerate(grads) if g.numel()]
    if not present:
        return torch.ones(len(grads), dtype=torch.bool, device=grads[0].device if grads else None)
    seen = [grads[k] for k in present]
    flags = _cpu_flags(seen, limit) if decides_like(seen[0]) == "cpu" else _within(_largest(seen), limit)
    if len(present) == len(grads):
        return flags
    out = torch.ones(len(grads), dtype=torch.bool, device=flags.device)
    out[present] = flags
    return out


#: On a CPU, a gradient of at least this many entries is checked by its least and largest
#: entries (``aminmax``, one vectorised pass), not by its infinity norm (a slower pass there).
CPU_MINMAX = 2**16


def _largest(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor's largest magnitude, ``(len(grads),)``: one foreach infinity norm."""
    norms: Sequence[torch.Tensor] = torch._foreach_norm(list(grads), INF_NORM)
    if len({n.dtype for n in norms}) > 1:
        norms = [n.float() for n in norms]
    return torch.stack(list(norms))


def _within(t: torch.Tensor, limit: float) -> torch.Tensor:
    return t < limit if limit == INF_NORM else t <= limit


def _cpu_flags(grads: Sequence[torch.Tensor], limit: float) -> torch.Tensor:
    """:func:`finite_flags` on a CPU: the large tensors by ``aminmax`` (a NaN fails both
    bounds), the others by one foreach infinity norm."""
    large = [k for k, g in enumerate(grads) if g.numel() >= CPU_MINMAX]
    if not large:
        return _within(_largest(grads), limit)
    flags: list[torch.Tensor | None] = [None] * len(grads)
    for k in large:
        low, high = torch.aminmax(grads[k])
        flags[k] = _within(high, limit) & _within(-low, limit)
    small = [k for k in range(len(grads)) if flags[k] is None]
    if small:
        for k, flag in zip(small, _within(_largest([grads[k] for k in small]), limit).unbind(0)):
            flags[k] = flag
    return torch.stack(flags)  # type: ignore[arg-type]


def sanitize(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``grad`` in ``dtype`` with its NaN and Inf entries set to 0.

    The skip itself is the 0 step weight of a non-finite parameter; this only keeps
    ``0 * NaN`` out of the arithmetic. ``grad`` itself is never written: the caller's
    gradient (and any graph that saved it) stays as it was.
    """
    if grad.dtype != dtype:
        return torch.nan_to_num_(grad.to(dtype), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)


def sanitize_all(grads: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """:func:`sanitize` of every ``(grad, dtype)``: gradients of one shape, dtype and device
    are stacked (the copy :func:`sanitize` makes anyway) and cleaned in one pass, so the
    operators grow with the number of shapes, not of gradients. Returns views of the stacks."""
    out: list[torch.Tensor | None] = [None] * len(grads)
    same: dict[tuple, list[int]] = {}
    for k, (g, dtype) in enumerate(zip(grads, dtypes)):
        same.setdefault((tuple(g.shape), g.dtype, g.device, dtype), []).append(k)
    for (_, _, _, dtype), members in same.items():
        if len(members) == 1:
            out[members[0]] = sanitize(grads[members[0]], dtype)
            continue
        stack = torch.stack([grads[k] for k in members])
        if stack.dtype != dtype:
            stack = stack.to(dtype)
        torch.nan_to_num_(stack, nan=0.0, posinf=0.0, neginf=0.0)
        for k, t in zip(members, stack.unbind(0)):
            out[k] = t
    return out  # type: ignore[return-value]


def _lerps_(starts: Sequence[torch.Tensor], ends: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> None:
    """``starts[k].lerp_(ends[k], weights[k])`` for every ``k``: one foreach operator (one per
    tensor when traced by Dynamo, which cannot trace a list of weights; one graph anyway)."""
    if torch.compiler.is_compiling():
        for a, b, w in zip(starts, ends, weights):
            a.lerp_(b, w)
    else:
        torch._foreach_lerp_(list(starts), list(ends), list(weights))


def momenta_(
    bufs: list[torch.Tensor], grads: list[torch.Tensor], okfs: list[torch.Tensor], beta: float, nesterov: bool
) -> list[torch.Tensor]:
    """EMA momentum ``M <- beta M + (1 - beta) G`` in place for every ``(buf, grad, okf)``
    (a no-op where ``okf`` is 0), in two or three foreach operators; returns the directions
    ``D``: the buffers, or with Nesterov new tensors ``beta M + (1 - beta) G``."""
    if not bufs:
        return []
    _lerps_(bufs, grads, torch._foreach_mul(okfs, 1.0 - beta))
    if nesterov:
        return list(torch._foreach_lerp(grads, bufs, beta))
    return bufs


def decays_(params: list[torch.Tensor], lr, weight_decay: float, okfs: list[torch.Tensor]) -> None:
    """Decoupled weight decay ``W <- (1 - lr wd) W`` of every ``(p, okf)`` (multiplies by
    exactly 1 where skipped), in three foreach operators."""
    if weight_decay and params:
        torch._foreach_mul_(params, torch._foreach_add(torch._foreach_mul(okfs, -(lr * weight_decay)), 1.0))


def _guarded(f: Factored) -> tuple[Factored, torch.Tensor]:
    """``f`` with its non-finite entries zeroed, and the update's finite flag (0-d bool).

    The flag is read from the small factors (row scales, ``R``, shifts: a non-finite
    work matrix makes them non-finite too, see :mod:`equiopt.maps`) or, for an update
    given whole, from the update itself, which is then cleaned in place (it is always a
    fresh tensor). No host read: a non-finite update adds ``0`` to the weights.
    """
    names = [k for k in ("row", "left", "right", "shift") if getattr(f, k) is not None]
    ok = finite_flags([getattr(f, k) for k in names] or [f.x], INF_NORM).all()
    if names:
        if f.low is not None:  # a fresh copy of x: a NaN there would survive the zeroed factor
            torch.nan_to_num_(f.low, nan=0.0, posinf=0.0, neginf=0.0)
        return f._replace(**{k: torch.nan_to_num(getattr(f, k), nan=0.0, posinf=0.0, neginf=0.0) for k in names}), ok
    torch.nan_to_num_(f.x, nan=0.0, posinf=0.0, neginf=0.0)
    return f, ok


def add_factored_(pw: torch.Tensor, f: Factored, coef: torch.Tensor) -> torch.Tensor:
    """``pw += coef * U`` for the update ``U`` that ``f`` stands for, in place; returns the
    update's finite flag (0-d bool: a non-finite update is not added, see :func:`_guarded`;
    a skipped parameter, ``coef = 0``, counts as finite: its gradient's flag counts it).

    ``pw`` is a work view of the parameter (writing to it writes the parameter). The
    scalar ``coef`` (``-lr * shape factor * ok``) is folded into the small factor, so a
    one-sided or hybrid update is a single accumulating GEMM into the weights and a
    row-norm update a single ``addcmul``; no full-size update tensor is formed.
    """
    f, ok = _guarded(f)
    _add_(pw, f, coef * ok)
    return ok | (coef == 0)


def add_updates_(views: list[torch.Tensor], updates: list[torch.Tensor], coefs: list[torch.Tensor]) -> torch.Tensor:
    """:func:`add_factored_` of many whole updates (fresh tensors of their views' dtype; the
    ``coefs`` 0-d tensors of one dtype) in a number of operators that does not grow with
    their count where they tile a few buffers (:func:`_cleaned`): ``views[k] += coefs[k] * updates[k]``,
    a non-finite update adding nothing; returns the ``(N,)`` flags as :func:`add_factored_`."""
    ok = finite_flags(updates, INF_NORM)
    for t in _cleaned(updates):
        torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
    coef = torch.stack(coefs)
    torch._foreach_add_(views, torch._foreach_mul(updates, list((coef * ok).unbind(0))))
    return ok | (coef == 0)


def _cleaned(updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors to clean of NaN and Inf so that every update is clean: a buffer that the
    updates are views of and that they fill completely (a batched map's output, an owner
    exchange's receive buffer) once, any other update on its own."""
    by_base: dict[int, list[torch.Tensor]] = {}
    for u in updates:
        by_base.setdefault(id(u._base) if u._base is not None else id(u), []).append(u)
    out: list[torch.Tensor] = []
    for same in by_base.values():
        base = same[0]._base
        out.extend([base] if base is not None and _tiles(base, same) else same)
    return out


def _tiles(base: torch.Tensor, views: list[torch.Tensor]) -> bool:
    """Whether contiguous ``views`` of the contiguous ``base`` cover it exactly, end to end."""
    if not base.is_contiguous() or not all(v.is_contiguous() for v in views):
        return False
    at = base.storage_offset()
    for v in sorted(views, key=lambda v: v.storage_offset()):
        if v.storage_offset() != at:
            return False
        at += v.numel()
    return at == base.storage_offset() + base.numel()


def _scaled(t: torch.Tensor | None, coef: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t * coef


def _add_(pw: torch.Tensor, f: Factored, coef: torch.Tensor) -> None:
    # ``x`` scaled by one factor (or its rows' factors), nothing multiplied into it
    scaled = f.left is None and f.right is None and f.low is None
    if pw.dtype != f.x.dtype and not (scaled and pw.dtype == torch.promote_types(f.x.dtype, coef.dtype)):
        # Low-precision weights: form the update in the compute dtype, round once. (A narrow
        # polar factor with a scale in the weights' dtype is added as it is: widened as read.)
        pw.add_((materialize(f) * coef).to(pw.dtype))
        return
    if f.low is not None and (f.right is not None or f.left is not None):
        # bfloat16 operands (gram_dtype): the product in float32, then one add
        pw.add_(materialize(f._replace(shift=None, right=_scaled(f.right, coef), left=_scaled(f.left, coef))))
    elif f.row is not None and f.right is not None:
        # the hybrid's unformed first stage: U = (row * x) @ right, a block of rows at a time
        right = f.right * coef
        for a, b, z in row_scaled_blocks(f.x, f.row):
            if not gemm_(pw[..., a:b, :], z, right):
                pw[..., a:b, :].add_(z @ right)
    elif f.row is not None and f.shift is not None:
        from .fused.ops import row_add_  # (the fused operators read this module's constants)

        # a centred row map: its rows scaled and its shift subtracted in one pass over the weights
        row_add_(pw, f.x, f.row * coef, f.shift * coef)
        return
    elif f.row is not None:
        pw.addcmul_(f.x, f.row * coef)
    elif f.right is not None:
        if not gemm_(pw, f.x, f.right * coef):
            pw.add_(f.x @ (f.right * coef))
    elif f.left is not None:
        if not gemm_(pw, f.left * coef, f.x):
            pw.add_((f.left * coef) @ f.x)
    else:
        pw.addcmul_(f.x, coef)
    if f.shift is not None:
        pw.addcmul_(f.shift, coef, value=-1.0)


def adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    okfs: list[torch.Tensor],
    lr,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW with bias correction and decoupled decay on tensor-valued step counters.

    ``grads`` are already sanitised and in the moments' dtype. A skipped parameter keeps
    its step count and moments (its lerp weights are 0) and its weights: its step size
    is 0, folded in as a division of the denominator by it (``m / inf = 0``).
    """
    b1, b2 = betas
    torch._foreach_add_(steps, okfs)
    _lerps_(exp_avgs, grads, torch._foreach_mul(okfs, 1.0 - b1))
    # A skipped gradient may hold entries whose square overflows; at weight 0 lerp returns
    # v exactly only if g^2 is finite, so squares are capped at the dtype's max (a no-op
    # for every usable gradient, whose entries are within GRAD_LIMIT).
    squares = torch._foreach_mul(grads, grads)
    for dtype in {g.dtype for g in grads}:
        torch._foreach_clamp_max_([t for t in squares if t.dtype == dtype], torch.finfo(dtype).max)
    _lerps_(exp_avg_sqs, squares, torch._foreach_mul(okfs, 1.0 - b2))
    del squares
    denom = torch._foreach_sqrt(exp_avg_sqs)
    counts = [c.to(m.dtype) for c, m in zip(torch._foreach_maximum(steps, 1.0), exp_avgs)]
    bc1 = torch._foreach_add(torch._foreach_neg(torch._foreach_pow(b1, counts)), 1.0)
    bc2 = torch._foreach_add(torch._foreach_neg(torch._foreach_pow(b2, counts)), 1.0)
    # m / (sqrt(v / bc2) + eps) * (-lr ok / bc1) = m / ((sqrt(v) + c eps) / (-lr ok c / bc1)), c = sqrt(bc2):
    # two passes over the denominator, and a skipped step divides by 0 (m / inf = 0).
    c = torch._foreach_sqrt(bc2)
    torch._foreach_add_(denom, torch._foreach_mul(c, eps))
    torch._foreach_div_(denom, torch._foreach_div(torch._foreach_mul(torch._foreach_mul(okfs, -lr), c), bc1))
    if weight_decay:
        torch._foreach_mul_(params, torch._foreach_add(torch._foreach_mul(okfs, -lr * weight_decay), 1.0))
    same = [p.dtype == m.dtype for p, m in zip(params, exp_avgs)]
    if all(same):
        torch._foreach_addcdiv_(params, exp_avgs, denom)
        return
    for p, m, d in zip(params, exp_avgs, denom):
        p.add_((m / d).to(p.dtype))
