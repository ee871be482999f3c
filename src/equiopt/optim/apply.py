"""Applying updates to parameters without host reads (the optimizer's last stage).

Every function here takes the per-parameter *finite flag* ``ok`` (a 0-d tensor, 1 where
the gradient was finite, 0 where it was not) and folds it into the step size, so a
parameter whose gradient had a NaN or Inf keeps its weights and state bit for bit while
no Python branch ever looks at a tensor value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..maps import Factored, _gemm_, materialize, row_scaled_blocks

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

    One ``aminmax`` pass each (no temporary): ``min / 2 + max / 2`` is finite exactly when
    every entry is (an Inf or NaN propagates; halving keeps finite extremes from
    overflowing), unlike a sum or a 2-norm, which overflow for large finite gradients; a
    NaN fails the bound's comparisons too.
    """
    flags = []
    for g in grads:
        if g.numel() == 0:  # an empty shard (uneven sharding) has nothing to check
            flags.append(torch.ones((), dtype=torch.bool, device=g.device))
            continue
        lo, hi = torch.aminmax(g)
        lo, hi = lo.float(), hi.float()
        flags.append((0.5 * lo + 0.5 * hi).isfinite() & (lo >= -limit) & (hi <= limit))
    return torch.stack(flags)


def sanitize(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``grad`` in ``dtype`` with its NaN and Inf entries set to 0.

    The skip itself is the 0 step weight of a non-finite parameter; this only keeps
    ``0 * NaN`` out of the arithmetic. ``grad`` itself is never written: the caller's
    gradient (and any graph that saved it) stays as it was.
    """
    if grad.dtype != dtype:
        return torch.nan_to_num_(grad.to(dtype), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)


def momentum_(buf: torch.Tensor, grad: torch.Tensor, okf: torch.Tensor, beta: float, nesterov: bool) -> torch.Tensor:
    """EMA momentum ``M <- beta M + (1 - beta) G`` in place (a no-op where ``okf`` is 0);
    returns the direction ``D``: ``M``, or ``beta M + (1 - beta) G`` with Nesterov."""
    buf.lerp_(grad, okf * (1.0 - beta))
    if nesterov:
        return grad.lerp(buf, beta)
    return buf


def decay_(p: torch.Tensor, lr, weight_decay: float, okf: torch.Tensor) -> None:
    """Decoupled weight decay ``W <- (1 - lr wd) W`` (multiplies by exactly 1 where skipped)."""
    if weight_decay:
        p.mul_(1.0 - (lr * weight_decay) * okf)


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


def _scaled(t: torch.Tensor | None, coef: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t * coef


def _add_(pw: torch.Tensor, f: Factored, coef: torch.Tensor) -> None:
    if pw.dtype != f.x.dtype:
        # Low-precision weights: form the update in the compute dtype, round once.
        pw.add_((materialize(f) * coef).to(pw.dtype))
        return
    if f.low is not None and (f.right is not None or f.left is not None):
        # bfloat16 operands (gram_dtype): the product in float32, then one add
        pw.add_(materialize(f._replace(shift=None, right=_scaled(f.right, coef), left=_scaled(f.left, coef))))
    elif f.row is not None and f.right is not None:
        # the hybrid's unformed first stage: U = (row * x) @ right, a block of rows at a time
        right = f.right * coef
        for a, b, z in row_scaled_blocks(f.x, f.row):
            if not _gemm_(pw[..., a:b, :], z, right):
                pw[..., a:b, :].add_(z @ right)
    elif f.row is not None:
        pw.addcmul_(f.x, f.row * coef)
    elif f.right is not None:
        if not _gemm_(pw, f.x, f.right * coef):
            pw.add_(f.x @ (f.right * coef))
    elif f.left is not None:
        if not _gemm_(pw, f.left * coef, f.x):
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
    for m, g, w in zip(exp_avgs, grads, torch._foreach_mul(okfs, 1.0 - b1)):
        m.lerp_(g, w)
    # One temporary per parameter serves as g^2 and then as the denominator sqrt(v).
    denom = []
    for v, g, w in zip(exp_avg_sqs, grads, torch._foreach_mul(okfs, 1.0 - b2)):
        # A skipped gradient may hold entries whose square overflows; at weight 0 lerp
        # returns v exactly only if g^2 is finite, so squares are capped at the dtype's max
        # (a no-op for every usable gradient, whose entries are within GRAD_LIMIT).
        t = torch.mul(g, g).clamp_(max=torch.finfo(g.dtype).max)
        v.lerp_(t, w)
        denom.append(torch.sqrt(v, out=t))
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
