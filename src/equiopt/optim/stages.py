"""The tensor work of a bucket's step, on its parts' stacks alone: what ``compile=``
compiles once per kind of bucket (:class:`~.cores.Cores`), with no per-parameter operator.

:func:`bucket_core`: each part's finite flags, sanitising, momentum and direction (the
fused operators of :mod:`.fused` where the part's work matrices are its stack itself),
the centring of quotient maps, the map on every work matrix of the bucket at once, the
guard of each matrix's update (:func:`guard`) and each part's update with its learning
rate, shape factor and skip flags folded in. :func:`adamw_core`: AdamW on a part's stacked
moments. A part's constants are its :class:`Spec`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import maps
from ..layouts import Layout, Row
from .apply import GRAD_LIMIT, _add_
from .fused import ops as fused
from .rules import PRECENTRED, MapKey, finite_flags_of, rule_named
from .sharded_buckets import Agree, agree_all

__all__ = ["Spec", "guard", "bucket_core", "adamw_core"]


class Spec(NamedTuple):
    """What a part's core computes with besides its tensors: the constants of its compiled code."""

    layout: Layout | None
    members: int
    shape: tuple[int, ...]
    work_shape: tuple[int, ...]
    per_member: int
    factor: float
    beta: float
    nesterov: bool
    weight_decay: float
    single: bool  # one member in the state's dtype: read from its gradient, its update added in place
    dtype: torch.dtype
    flat: bool
    numel: int
    betas: tuple[float, float]
    adam_eps: float
    beta2: float = 0.0  # NorMuon's row second-moment EMA
    work_is_view: bool = True  # a stack's work tensor is the stack itself, reshaped (no transpose)
    update_in_place: bool = False  # the update is added from the part's place in the buffer
    add_factor: bool = False  # a scaled narrow factor is added as it is read (equiopt::factor_add_)


def _lead(spec: Spec, t: torch.Tensor, ndim: int, sizes: torch.Tensor | None = None) -> torch.Tensor:
    """``(B,)`` ``t`` (one value per member) spread over a stack of ``ndim`` dimensions: a
    broadcasting view, or for a flat part each value repeated over its member's entries."""
    if spec.flat:
        return torch.repeat_interleave(t, sizes, output_size=spec.numel)  # type: ignore[arg-type]
    return t.view(-1, *([1] * (ndim - 1)))


def _leads(spec: Spec, values: list[torch.Tensor], ndim: int, sizes: torch.Tensor | None) -> list[torch.Tensor]:
    """:func:`_lead` of several ``(B,)`` values: for a flat part, spread in one operator
    (stacked where they share a dtype)."""
    if not spec.flat or len({v.dtype for v in values}) > 1:
        return [_lead(spec, v, ndim, sizes) for v in values]
    spread = torch.repeat_interleave(torch.stack(values), sizes, dim=1, output_size=spec.numel)  # type: ignore[arg-type]
    return list(spread.unbind(0))


def _gradients(
    spec: Spec,
    source: torch.Tensor,
    scratch: torch.Tensor,
    present: torch.Tensor | None,
    finite: torch.Tensor | None,
    counters: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sanitised gradients (in ``scratch``: NaN and Inf set to 0), the finite flags (``(B,)``
    bool: free of NaN and Inf, every entry within ``GRAD_LIMIT``, present) and the flags a step
    reports (True for a member without a gradient); skips counted in ``counters``."""
    if finite is None:
        seen = source.reshape(spec.members, -1)
        # two reductions (aminmax along a dimension is many times slower on a CPU); NaN fails both
        finite = (seen.amin(dim=1) >= -GRAD_LIMIT) & (seen.amax(dim=1) <= GRAD_LIMIT)
    if present is not None:
        bad = present & ~finite
        ok, reported = finite & present, ~bad
    else:
        ok, bad, reported = finite, ~finite, finite
    counters.add_(bad)
    if spec.single:  # copied and sanitised in one pass
        torch.nan_to_num(source, nan=0.0, posinf=0.0, neginf=0.0, out=scratch.view(source.shape))
    else:
        torch.nan_to_num_(scratch, nan=0.0, posinf=0.0, neginf=0.0)
    return scratch, ok, reported


def _pieces(f: maps.Factored, take: Callable[[torch.Tensor], torch.Tensor]) -> maps.Factored:
    """``f`` with ``take`` applied to each of its tensors (a view of some of its matrices)."""
    return maps.Factored(take(f.x), *[None if t is None else take(t) for t in f[1:]])


def _scaled(f: maps.Factored, c: torch.Tensor) -> maps.Factored:
    """``f`` for ``c * U`` (``c``: ``(N, 1, 1)``), the scale folded into its smallest factor."""
    shift = None if f.shift is None else f.shift * c
    if f.row is not None:
        return f._replace(row=f.row * c, shift=shift)
    if f.right is not None:
        return f._replace(right=f.right * c, shift=shift)
    if f.left is not None:
        return f._replace(left=f.left * c, shift=shift)
    return f._replace(x=f.x * c, shift=shift)


def _finite(t: torch.Tensor) -> torch.Tensor:
    """``t.isfinite()`` in two operators (``t - t`` is 0 exactly where ``t`` is finite)."""
    return (t - t) == 0


def guard(
    f: maps.Factored, made: bool = False, clean: bool = True, known: torch.Tensor | None = None
) -> tuple[maps.Factored, torch.Tensor]:
    """``f`` (a batch of ``N`` updates) with its non-finite entries zeroed, and each update's
    finite flag (``(N,)`` bool), read from its small factors, or from the update itself when
    it is given whole (then cleaned in place: it is always a fresh tensor). ``made``: ``f.x``
    is a tensor the map made (a narrow polar factor beside its scale), not its input, so it
    is read and cleaned too. Without ``clean`` a made ``f.x`` is read, not cleaned: its
    reader zeroes what is not finite as it reads it (:func:`~.fused.ops.factor_add_`).
    ``known``: ``f.x``'s flags where the map knew them (:attr:`~.rules.Rule.checks`): it is
    not read for them. The batched form of :func:`~.apply._guarded`."""
    names = [k for k in ("row", "left", "right", "shift") if getattr(f, k) is not None]
    checked = [getattr(f, k) for k in names] + ([f.x] if made and names and known is None else [])
    if not checked and known is None:
        checked = [f.x]
    ok: Any = known
    if checked:
        flag = finite_flags_of(checked)
        ok = flag if ok is None else ok & flag
    if names:
        if f.low is not None:
            torch.nan_to_num_(f.low, nan=0.0, posinf=0.0, neginf=0.0)
        if made and clean:
            torch.nan_to_num_(f.x, nan=0.0, posinf=0.0, neginf=0.0)
        return f._replace(**{k: torch.nan_to_num(getattr(f, k), nan=0.0, posinf=0.0, neginf=0.0) for k in names}), ok
    if clean or not made:
        torch.nan_to_num_(f.x, nan=0.0, posinf=0.0, neginf=0.0)
    return f, ok


def _adds_factor(spec: Spec, f: maps.Factored, made: bool, placed_update: bool) -> bool:
    """Whether a part's update is its narrow factor scaled per work matrix, added by its
    finish as it is read (:func:`~.fused.ops.factor_add_`): a map's own factor with at most
    one row factor per matrix, no shift or side factor, and a part of several members whose
    update would otherwise be written into its place."""
    return (
        made
        and placed_update
        and spec.add_factor
        and f.left is None
        and f.right is None
        and f.shift is None
        and (f.row is None or f.row.shape[-2] == 1)
    )


def _side_by_side(
    places: list[torch.Tensor], specs: tuple[Spec, ...], works: list[torch.Tensor], placed: list[bool]
) -> None:
    """``torch.cat(works)`` without a new tensor: each part's work matrices into its place in
    the bucket's buffer (over its own spent gradients)."""
    for place, spec, w, there in zip(places, specs, works, placed):
        if not (there or (spec.nesterov and spec.work_is_view)):  # else the direction is there already
            place.copy_(w)


def _centred_as_read(key: MapKey, spec: Spec, momentum: torch.Tensor) -> bool:
    """Whether a part centred in place (``PRECENTRED``) takes its gradient in centred instead:
    a float32 stack of 2-D matrices stored as their work matrices (layout ``row``), whose
    column sums the flags operator makes as it reads the gradients and the momentum stage
    subtracts as it reads them; its momentum, kept in the quotient, then stays there
    (:meth:`~.buckets.Part.keep_centred` centres it where it is made or adopted)."""
    return (
        key.center == PRECENTRED
        and momentum.dtype == torch.float32
        and not spec.flat
        and isinstance(spec.layout, Row)
        and len(spec.shape) == 2
    )


def _sums_by_the_way(key: MapKey, spec: Spec, momentum: torch.Tensor) -> tuple[int, int]:
    """``(k, run)``: the ``k`` sums of squares per member the momentum stage makes for the map
    as it writes the direction (``k`` 0: none; ``run``: its entries counted in runs, in turn,
    0 for ``k`` equal consecutive pieces), in float32 and uncentred maps only: each row's for
    ``Rule.sums == "rows"`` (RowNormM) on a matrix stored as its work matrix (layout ``row``:
    the work rows are the stored rows in order); each work matrix's for ``"matrices"``
    (Muon's normalisation) where a member is one work matrix, in any layout (a transpose
    keeps its Frobenius norm), or several whose entries its layout places in runs
    (:meth:`~equiopt.layouts.Layout.segments`: heads along rows or columns)."""
    wanted = rule_named(key.rule).sums_for(key)
    centred = key.center and not _centred_as_read(key, spec, momentum)
    if centred or momentum.dtype != torch.float32 or spec.flat or wanted is None:
        return 0, 0
    if wanted == "rows":
        return (spec.shape[0], 0) if isinstance(spec.layout, Row) and len(spec.shape) == 2 else (0, 0)
    if wanted != "matrices":
        return 0, 0
    if spec.per_member == 1:
        return 1, 0
    runs = None if spec.layout is None else spec.layout.segments(spec.shape)
    if runs is None or runs[1] != spec.per_member:
        return 0, 0
    run, count = runs
    return count, 0 if run * count == math.prod(spec.shape) else run


def _placed_directly(key: MapKey, spec: Spec) -> bool:
    """Whether the fused operators of :mod:`.fused` write a part's direction straight into
    its place in the map's input: a stack whose work matrices are the stack itself, not
    centred in place (every other part's direction is copied or centred there after them)."""
    return spec.work_is_view and not spec.flat and key.center != PRECENTRED


def _straight_into_place(key: MapKey, spec: Spec, source: Any, place: torch.Tensor | None) -> torch.Tensor | None:
    """For a part whose work matrices are not its stack (transposed, or heads split along
    columns) and whose gradients are read where they are (``source`` a list): its place in
    the map's input seen in the stored layout (a view of it where ``spec.update_in_place``),
    ``(B, rows, cols)`` strided, where the fused momentum operator writes the direction;
    None where that does not apply."""
    if place is None or spec.work_is_view or spec.flat or not spec.update_in_place or key.center == PRECENTRED:
        return None
    if not isinstance(source, list):  # (stacked gradients fill the place first)
        return None
    stored = spec.layout.stacked_from_work([place.view(spec.members, *spec.work_shape)])  # type: ignore[union-attr]
    return stored if stored.dim() == 3 else None


def bucket_core(
    key: MapKey,
    eta: Any,
    specs: tuple[Spec, ...],
    sources: list[Any],
    scratches: list[torch.Tensor],
    presents: list[torch.Tensor | None],
    momenta: list[torch.Tensor],
    counters: list[torch.Tensor],
    lrs: list[torch.Tensor],
    weights: list[torch.Tensor | None],
    skips: torch.Tensor,
    map_fn: Callable[..., maps.Factored],
    seconds: list[torch.Tensor] | None = None,
    region: torch.Tensor | None = None,
    places: list[torch.Tensor] | None = None,
    agrees: list[Agree | None] | None = None,
) -> tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]:
    """The tensor work of one bucket's step, on its parts' stacks alone (what is compiled,
    once per kind of bucket; no per-parameter operator): each part's flags, sanitising and
    momentum (and centring), the map (``map_fn``, :func:`~.rules.factored_map`) on every work
    matrix at once (``normuon``: then each part's row stage, :func:`~equiopt.maps.normuon_rows`,
    on its stacked row second moments ``seconds``, a skipped member's left as they were), the
    guard of each matrix's update (refusals counted in ``skips``), and each part's update with
    its learning rate, shape factor and skip flags folded in.

    ``agrees``: per part, None or what makes a sharded part's flags global
    (:class:`~.sharded_buckets.Agree`, :func:`~.sharded_buckets.agree_all`), applied
    before the momentum reads them.

    ``region``: the bucket's gradient buffer as work matrices, ``places`` each part's
    (its ``scratches`` entry) in it. Once a part's momentum has taken its gradients, the
    map's input (the parts' work matrices side by side) is written there, and after the
    map each part's update: a step allocates no copy of the bucket besides the map's own.

    Returns, per part: the update as a ``(B, *shape)`` stack to add, None where it is in
    the part's scratch (its :meth:`Part.finish` adds it from there) or, for a
    single-member part, the core applied its decay and update to ``weights[i]`` in place,
    or a narrow factor and its scales, ``(X, k)``, which the part's finish adds as ``k X``;
    the skip flags (bool: True where the member steps), and the flags the step reports."""
    works, coefs, okls, reported, weights2 = [], [], [], [], []
    steps: dict[tuple[int, float], torch.Tensor] = {}
    made_sums: list[torch.Tensor | None] = []  # what the map reads first (Rule.sums), where the momentum stage made it
    placed = [_placed_directly(key, spec) for spec in specs]
    target: torch.Tensor | None = None
    # each part's flags first (a sharded part's agreed with the ranks that hold its other
    # pieces, one all-reduce per process group for the whole bucket), then its momentum
    read = []
    for i, spec in enumerate(specs):
        buf = momenta[i]
        # (a part centred in place keeps the unfused operators under compile: Inductor
        # misorders the fused momentum stage's write of the momentum and the centring's
        # in-place update after it; it fuses those operators itself there)
        fused_in = not spec.flat and (key.center != PRECENTRED or not torch.compiler.is_compiling())
        # (a centred part whose gradient enters its momentum centred: column sums with the flags)
        centred_in = fused_in and _centred_as_read(key, spec, buf)
        cols = None
        if fused_in:
            # flags, sanitising, momentum and direction in two fused operators (the direction
            # lands in the part's scratch, which is its place in the map's input where ``placed``)
            # (a list: each member's gradient where autograd left it, read there, never stacked)
            src = sources[i]
            cols = buf.new_empty(spec.members, spec.shape[-1]) if centred_in else None
            ok, flags = fused.grad_flags(
                src if isinstance(src, list) else [src], counters[i], presents[i], spec.members, cols
            )
            grads = scratches[i]
        else:
            grads, ok, flags = _gradients(spec, sources[i], scratches[i], presents[i], None, counters[i])
        read.append((fused_in, centred_in, cols, grads, ok, flags))
    if agrees is not None:
        agreed = agree_all(agrees, [r[4] for r in read], [r[5] for r in read], counters, presents)
        read = [r[:4] + a for r, a in zip(read, agreed)]
    for i, spec in enumerate(specs):
        buf = momenta[i]
        fused_in, centred_in, cols, grads, ok, flags = read[i]
        reported.append(flags)
        okls.append(ok)  # (a product with the flags is exactly the factor, or 0: they multiply as they are)
        # in the gradients' dtype where an unfused stage, a centring or a row stage reads them
        okf = ok.to(grads.dtype) if not fused_in or key.center == PRECENTRED or seconds is not None else ok
        weight = weights[i]
        if weight is not None and spec.weight_decay:
            weight.mul_(1.0 - (lrs[i] * spec.weight_decay) * ok[0])
        # EMA momentum M <- beta M + (1 - beta) G (weight 0 where skipped); Nesterov's direction
        # over G. A transposed one beside other parts goes into the bucket's buffer over this
        # part's own gradients: it is made apart first, in a fresh tensor copied there below,
        # unless the gradients are read where autograd left them (then it is written straight
        # into its place, through the stored layout's view of it).
        straight = _straight_into_place(key, spec, sources[i], places[i] if places is not None else None)
        apart = spec.nesterov and not spec.work_is_view and region is not None and len(specs) > 1 and straight is None
        if fused_in:
            src = sources[i]
            given = src if isinstance(src, list) else [src] if spec.single else []
            target = grads if straight is None else straight
            if apart:
                given, target = given or [grads], torch.empty_like(grads)
            placed[i] = placed[i] or straight is not None
            # without Nesterov the direction is the momentum: the map reads it there unless it
            # must be in the part's place beside other parts
            written = spec.nesterov or (placed[i] and len(specs) > 1) or straight is not None
            per, run = _sums_by_the_way(key, spec, buf)
            sums = buf.new_empty(spec.members, per) if per else None
            shift = None if cols is None else cols / spec.shape[0]  # the gradients' column means
            fused.momentum_stage(given, target, buf, ok, spec.beta, spec.nesterov, written, sums, run, shift)
            if sums is not None:  # (B, rows, 1) for a row map, else (B P, 1, 1): one per work matrix
                sums = sums.view(-1, 1, 1) if spec.per_member > 1 else sums.view(spec.members, per, 1)
            made_sums.append(sums)
            direction = target if written else buf
        else:
            made_sums.append(None)
            buf.lerp_(grads, _lead(spec, okf * (1.0 - spec.beta), buf.ndim))
            if spec.nesterov:
                direction = torch.lerp(grads, buf, spec.beta) if apart else grads.lerp_(buf, spec.beta)
            else:
                direction = buf
        work = spec.layout.stacked_to_work(direction)[0]  # type: ignore[union-attr]
        if key.center == PRECENTRED and not centred_in:
            # D <- Pi D in place (see the engine's _centre_in_place); a skipped member stays
            work.sub_(work.mean(dim=-2, keepdim=True).mul_(_lead(spec, okf, work.ndim)))
        works.append(work.reshape(-1, *spec.work_shape[-2:]))
        step = steps.get((id(lrs[i]), spec.factor))  # a learning rate times a shape factor, once a bucket
        if step is None:
            step = steps[(id(lrs[i]), spec.factor)] = lrs[i] * -spec.factor
        coef = torch.mul(ok, step)
        coefs.append(coef.repeat_interleave(spec.per_member) if spec.per_member > 1 else coef)
        if seconds is not None:
            w2 = okf * (1.0 - spec.beta2)
            weights2.append((w2.repeat_interleave(spec.per_member) if spec.per_member > 1 else w2).view(-1, 1, 1))
    del direction, work, target  # (the loop's last: a transposed Nesterov direction is freed once placed)
    if len(works) == 1:
        x = works[0]
    elif region is None:
        # (an owner-mapped bucket's parts may hold blocks of different shapes but equal sizes:
        # the map's input carries them end to end in the first one's shape)
        x = torch.cat(
            [w if w.shape[-2:] == works[0].shape[-2:] else w.reshape(-1, *works[0].shape[-2:]) for w in works]
        )
    else:
        assert places is not None
        _side_by_side(places, specs, works, placed)
        x, works = region, places
    # Muon's polar factor stays in its iteration's dtype: the guard reads it and each part's
    # update widens it as it scales it (one pass fewer over the bucket than a cast back)
    rule = rule_named(key.rule)
    narrow = rule.narrow
    hints = {}
    if made_sums and all(t is not None and t.shape[1:] == made_sums[0].shape[1:] for t in made_sums):  # type: ignore[union-attr]
        # the map reads D once less
        hints["sums"] = made_sums[0] if len(made_sums) == 1 else torch.cat(made_sums)  # type: ignore[arg-type]
    if rule.checks and narrow:  # the map says which factors are finite (the guard reads none for it)
        hints["finite"] = torch.empty(x.shape[0], dtype=torch.bool, device=x.device)
    f = map_fn(key, eta, x, narrow=True, **hints) if narrow else map_fn(key, eta, x, **hints)
    cdtype = torch.promote_types(x.dtype, f.x.dtype)  # (the scale in the dtype the update is formed in)
    if seconds is not None:
        # the rule's row stage (NorMuon's), part by part on its own state (views of the stacks)
        rows: list[torch.Tensor] = []
        at2 = 0
        for spec, w, second, w2 in zip(specs, works, seconds, weights2):
            n = w.shape[0]
            v = second.view(n, spec.work_shape[-2], 1)
            rows.append(rule.row_stage(f.x.narrow(0, at2, n), v, w2, key.eps))
            at2 += n
        f = f._replace(row=rows[0] if len(rows) == 1 else torch.cat(rows))
    made = narrow and f.x is not x  # the map's own tensor (a narrow factor), not its input
    adds = [_adds_factor(spec, f, made, places is not None and spec.update_in_place) for spec in specs]
    # (where every part's finish reads the factor, it zeroes what is not finite as it reads)
    f, ok = guard(f, made=made, clean=not all(adds), known=hints.get("finite") if made else None)
    coef = coefs[0] if len(coefs) == 1 else torch.cat(coefs)
    skips.add_(coef.masked_fill(ok, 0).count_nonzero())  # the refused matrices that had a step
    coef = (coef * ok).to(cdtype)  # (every part's scales in one conversion)
    updates: list[Any] = []
    at = 0
    for i, (spec, w, weight) in enumerate(zip(specs, works, weights)):
        n = w.shape[0]
        piece = f if len(works) == 1 else _pieces(f, lambda t: t.narrow(0, at, n))
        if piece.x.shape[-2:] != w.shape[-2:]:  # (a block carried in another part's shape)
            piece = piece._replace(x=piece.x.view(n, *w.shape[-2:]))
        c = coef.narrow(0, at, n).view(-1, 1, 1)
        at += n
        if weight is not None:
            # one parameter: the factored update goes straight into its work views
            view = spec.layout.to_work_list(weight.detach())[0]  # type: ignore[union-attr]
            lead = view.shape[:-2]
            _add_(
                view,
                _pieces(piece, lambda t: t.view(*lead, *t.shape[-2:])),
                c.view(*lead, 1, 1) if lead else c.view(()),
            )
            updates.append(None)
            continue
        if places is not None and spec.update_in_place:
            # into the part's place, whose gradients and map input are spent (every piece of
            # ``f`` read here is this part's own: the parts before it wrote only their places)
            out = places[i]
            if piece.left is None and piece.right is None and (piece.row is None or piece.row.shape[-2] == 1):
                # U = k x - shift with one factor k per matrix: widened as scaled, in one pass
                k = c if piece.row is None else piece.row * c
                if adds[i]:
                    # a narrow factor: formed as the part's finish adds it (no update written)
                    updates.append((piece.x, k))
                    continue
                if torch.compiler.is_compiling():  # (functionalised ``out=`` wants matching strides)
                    out.copy_(piece.x * k)
                else:
                    torch.mul(piece.x, k, out=out)
                if piece.shift is not None:
                    out.sub_(piece.shift * c)
            else:
                out.copy_(maps.materialize(_scaled(piece, c)))
            updates.append(None)
            continue
        u = maps.materialize(_scaled(piece, c))
        if u.dtype != spec.dtype:
            u = u.to(spec.dtype)
        updates.append(spec.layout.stacked_from_work([u.view(spec.members, *spec.work_shape)]))  # type: ignore[union-attr]
    return updates, okls, reported


def adamw_core(
    spec: Spec,
    source: torch.Tensor,
    scratch: torch.Tensor,
    present: torch.Tensor | None,
    finite: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    steps: torch.Tensor,
    counters: torch.Tensor,
    lr: torch.Tensor,
    sizes: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """AdamW with bias correction on a part's stacked moments (the engine's ``adamw`` rule;
    see :func:`~.apply.adamw_`): a skipped member keeps its step count and moments. Leaves
    ``m / denominator``'s denominator in ``scratch`` for the eager ``addcdiv`` (or returns the
    update where the parameters' dtype differs from the state's), with the skip flags in the
    learning rate's dtype and the reported flags."""
    b1, b2 = spec.betas
    grads, ok, reported = _gradients(spec, source, scratch, present, finite, counters)
    okf = ok.to(grads.dtype)
    steps.add_(okf)
    counts = steps.clamp(min=1.0).to(exp_avg.dtype)
    bc1 = 1.0 - torch.pow(b1, counts)
    c = torch.sqrt(1.0 - torch.pow(b2, counts))
    okl = okf.to(lr.dtype)
    size = (okl * -lr) * c.to(lr.dtype) / bc1.to(lr.dtype)
    # m / (sqrt(v / bc2) + eps) * (-lr ok / bc1) = m / ((sqrt(v) + c eps) / (-lr ok c / bc1)):
    # a skipped step divides by 0 (m / inf = 0); each member's four factors spread at once
    w1, w2, shift, scale = _leads(
        spec, [okf * (1.0 - b1), okf * (1.0 - b2), c * spec.adam_eps, size.to(grads.dtype)], exp_avg.ndim, sizes
    )
    exp_avg.lerp_(grads, w1)
    # a skipped gradient may hold entries whose square overflows: squares are capped
    sq = torch.mul(grads, grads, out=grads).clamp_(max=torch.finfo(grads.dtype).max)
    exp_avg_sq.lerp_(sq, w2)
    denom = torch.sqrt(exp_avg_sq, out=sq)
    denom.add_(shift)
    denom.div_(scale)
    update = None if spec.dtype == exp_avg.dtype else torch.div(exp_avg, denom).to(spec.dtype)
    return update, okl, reported
