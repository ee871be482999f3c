"""The per-parameter step: the parameters no bucket holds (sharded and divided ones,
``lazy`` rows, multi-block layouts, ``nonfinite="raise"``, peers aside).

Per parameter, with gradient ``G`` (Algorithms 1 and 2 of the paper):

    M <- beta M + (1 - beta) G                      (EMA momentum; Nesterov: D = beta M + (1 - beta) G, else D = M)
    U <- layout.from_work(map(layout.to_work(D)))   (the group's rule on the work matrices)
    W <- (1 - lr wd) W - lr s U                     (decoupled weight decay; s = lr_scale factor)

Each stage is one foreach operator over a group's parameters; the maps are queued for
:func:`.distribute.run`, which batches same-shaped work of all groups, distributes it as each
parameter's :class:`~.sharded.Plan` says, and adds the updates (:func:`add_updates`).
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import TYPE_CHECKING

import torch

from .. import maps
from ..layouts import Layout
from . import distribute
from .apply import GRAD_LIMIT, adamw_, add_factored_, add_updates_, decays_, finite_flags, momenta_, sanitize_all
from .costs import replica_division, resolve_cost_model
from .distribute import DIVIDED, REDUCE, ROWS, BucketKey, WholeTask, WorkItem
from .distribute import LOCAL as LOCAL_MODE
from .errors import NonFiniteGradientError
from .row_moments import ROW_MOMENT, row_moment_views
from .rules import MapKey, map_key, precentred, reducible, rule_of, shape_factor
from .sharded import Plan, ShardSum, global_flags, local, reducers

if TYPE_CHECKING:
    from .engine import EquivariantOptimizer


def _times(step: torch.Tensor, factor: float) -> torch.Tensor:
    """A step size ``-lr * ok`` times a shape factor (no operator when the factor is 1)."""
    return step if factor == 1.0 else step * factor


def real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor's real view (a trailing dimension of 2), any other tensor as it is."""
    return torch.view_as_real(t) if t.is_complex() else t


def step(opt: EquivariantOptimizer, lrs: list[torch.Tensor], covered: set[int]) -> list[tuple[list[str], torch.Tensor]]:
    """Step every parameter with a gradient that no bucket holds (``covered``: the ids of
    those that one does): the finite flags of all of them at once (one pass over the
    gradients, one all-reduce per process group), then group by group momentum, decay, and
    each map queued for :func:`.distribute.run`, which maps and adds them. Returns each
    group's parameter names and finite flags."""
    last_flags: list[tuple[list[str], torch.Tensor]] = []
    buckets: dict[BucketKey, list[WorkItem]] = defaultdict(list)
    whole: list[WholeTask] = []
    entries = []
    for group, lr in zip(opt.param_groups, lrs):
        live = [j for j, p in enumerate(group["params"]) if p.grad is not None and id(p) not in covered]
        if live and rule_of(group).kind != "peer":
            entries.append((group, lr, live, [group["params"][j] for j in live]))
    if entries:
        every = [p for *_, params in entries for p in params]
        sizes = [len(params) for *_, params in entries]
        flags = global_flags(_finite_flags(every), [opt._sharding(p) for p in every])
        per_group = flags.split(sizes)
        names_of = [[group["names"][j] for j in live] for group, _, live, _ in entries]
        for (group, *_), gflags, names in zip(entries, per_group, names_of):
            if group["nonfinite"] == "raise":  # before any state changes
                raise_nonfinite(gflags, names)
        states_of = [[opt._init_state(p, group) for p in params] for group, _, _, params in entries]
        okfs, ok32 = ok_floats(opt, flags, every)
        counters = [st["nonfinite"] for states in states_of for st in states]
        torch._foreach_add_(counters, torch._foreach_add(torch._foreach_neg(ok32), 1.0))
        at = 0
        for (group, lr, live, params), states, gflags, names, size in zip(
            entries, states_of, per_group, names_of, sizes
        ):
            last_flags.append((names, gflags))
            group_okfs, at = okfs[at : at + size], at + size
            if rule_of(group).adam:
                adamw_steps(group, lr, params, states, group_okfs)
            else:
                matrix_steps(opt, group, lr, live, params, states, group_okfs, buckets, whole)
    added: list[torch.Tensor] = []
    distribute.run(
        buckets,
        whole,
        partial(add_updates, added),
        replicas=opt._replicas,
        overlap=opt.overlap,
        cost_model=opt.cost_model,
        owner_families=opt._buckets.owner_families if opt._buckets is not None else frozenset(),
    )
    if added:  # the refused updates of the whole step counted at once
        skips = opt._skip_counter()
        ok = added[0] if len(added) == 1 else torch.cat([f.to(skips.device) for f in added])
        skips.add_(ok.logical_not().sum().to(skips.device, torch.float32))
    return last_flags


def _finite_flags(params: list) -> torch.Tensor:
    """:func:`~.apply.finite_flags` of the parameters' gradients (their local blocks), one
    pass per device."""
    grads = [real(local(p.grad)) for p in params]
    devices = {g.device for g in grads}
    if len(devices) == 1:
        return finite_flags(grads)
    first = next(iter(devices))
    out = torch.empty(len(grads), dtype=torch.bool, device=first)
    for device in devices:
        ks = [k for k, g in enumerate(grads) if g.device == device]
        out[ks] = finite_flags([grads[k] for k in ks]).to(first)
    return out


def raise_nonfinite(flags: torch.Tensor, names: list[str]) -> None:
    """``nonfinite="raise"``: the one policy that reads back (one host sync per group)."""
    bad = [name for name, ok in zip(names, flags.cpu().tolist()) if not ok]
    if bad:
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN, Inf, or entries beyond +-{GRAD_LIMIT:.3g}) in {', '.join(repr(b) for b in bad)}"
        )


def ok_floats(opt: EquivariantOptimizer, flags: torch.Tensor, params: list[torch.Tensor]):
    """Per parameter, its finite flag as a 0-d tensor in its state dtype (for step
    sizes) and in float32 (for the counters)."""
    ok32 = flags.to(torch.float32)
    wide = [opt._state_dtype(p) in (torch.float64, torch.complex128) for p in params]
    narrow = list(ok32.unbind(0))
    if not any(wide):
        return narrow, narrow
    ok64 = flags.to(torch.float64).unbind(0)
    return [ok64[k] if w else narrow[k] for k, w in enumerate(wide)], narrow


def add_updates(added: list[torch.Tensor], triples: list[tuple[torch.Tensor, maps.Factored, torch.Tensor]]) -> None:
    """Add work matrices' updates to their weights (guarded), their finite flags appended
    to ``added`` (the step counts the refused ones once): ``(view, update, coef)`` triples.
    Whole updates of the views' dtype go in together (:func:`~.apply.add_updates_`),
    factored ones one by one (:func:`~.apply.add_factored_`)."""
    flags = []
    whole: dict[tuple, list] = defaultdict(list)
    for view, f, coef in triples:
        if f.row is None and f.left is None and f.right is None and f.shift is None and f.low is None:
            if view.dtype == f.x.dtype:
                whole[(view.device, view.dtype, coef.dtype)].append((view, f.x, coef))
                continue
        flags.append(add_factored_(view, f, coef).reshape(1))
    for same in whole.values():
        if len(same) == 1:
            flags.append(add_factored_(same[0][0], maps.Factored(same[0][1]), same[0][2]).reshape(1))
        else:
            flags.append(add_updates_(*(list(t) for t in zip(*same))))
    added.extend(flags)


def matrix_steps(opt: EquivariantOptimizer, group, lr, live, params, states, okfs, buckets, whole) -> None:
    """Momentum and decay of the parameters of ``group`` that no bucket holds (each
    stage one foreach operator over all of them; on a DTensor, of this rank's block:
    ``p``, its gradient and state are DTensors, their local tensors are stepped), then
    each one's map queued (:meth:`_queue_map`)."""
    bufs = [real(local(st["momentum_buffer"])) for st in states]
    grads = sanitize_all([real(local(p.grad)) for p in params], [b.dtype for b in bufs])
    directions = momenta_(bufs, grads, okfs, group["beta"], group["nesterov"])
    weights = [real(local(p)) for p in params]
    decays_(weights, lr, group["weight_decay"], okfs)
    steps = torch._foreach_mul(okfs, -lr)  # -lr, or 0 where skipped
    if rule_of(group).kind == "elementwise":  # SGD: the direction is the update
        if group["lazy"]:
            directions = [
                lazy_rows(
                    d,
                    g,
                    group["layouts"][j],
                    opt.plan_of(group, group["layouts"][j], opt._sharding(p)),
                    group["names"][j],
                )
                for j, p, d, g in zip(live, params, directions, grads)
            ]
        for w, d, c in zip(weights, directions, steps):
            w.add_((d * c).to(w.dtype))
        return
    key = map_key(group)
    # each step size times its first work matrix's shape factor, in one operator (the
    # factor of the usual case: a parameter whose work matrices share one shape)
    factors = [
        shape_factor(group, *group["layouts"][j].work_shapes(opt._sharding(p).shape)[0][-2:])
        for j, p in zip(live, params)
    ]
    scaled = torch._foreach_mul(steps, factors) if any(f != 1.0 for f in factors) else steps
    for j, p, st, okf, step, d, g, w, first in zip(
        live, params, states, okfs, steps, directions, grads, weights, zip(factors, scaled)
    ):
        queue_map(opt, group, key, step, j, p, st, okf, d, g, w, buckets, whole, first)


def queue_map(
    opt: EquivariantOptimizer, group, key, step, j, p, state, okf, direction, grad, w, buckets, whole, first
) -> None:
    """Queue the map of one parameter's momentum ``direction`` (``w``: this rank's block
    of its weights) for :func:`.distribute.run`: in ``buckets`` (batched by settings,
    shape and mode; under ``divide_work`` the matrix-product maps of plain parameters are
    divided among the replicas) or in ``whole`` (split work that needs whole matrices).
    ``first``: a shape factor and ``step`` times it, made for the whole group at once."""
    sharding, rule = opt._sharding(p), rule_of(group)

    def times(factor: float) -> torch.Tensor:
        return first[1] if factor == first[0] else _times(step, factor)

    layout = group["layouts"][j]
    how = opt.plan_of(group, layout, sharding, key)
    if group["lazy"]:
        direction = lazy_rows(direction, grad, layout, how, group["names"][j])
    p = w
    if how.how == "owner":
        if rule.row_moments:  # the owner maps the whole matrix, each rank its rows' stage
            factor = shape_factor(group, *layout.work_shapes(sharding.shape)[0][-2:])
            second = (local(state[ROW_MOMENT]), okf * (1.0 - group["beta2"]), sharding.block)
            whole.append(WholeTask(group, key, layout, sharding, how, p, direction, times(factor), second))
        else:
            whole.append(WholeTask(group, key, layout, sharding, how, p, direction, step))
        return
    if how.how == "local" and rule.centres_in_place(group):
        key = centre_in_place(direction, layout, okf, key)
    global_shapes = layout.work_shapes(sharding.shape)
    sums = reducers(how, sharding, global_shapes[0]) if how.how == "reduce" else None
    divide = opt._replicas is not None and sharding.kind == "local" and rule.divisible
    division = None
    if divide and reducible(key, *global_shapes[0][-2:]) and len(global_shapes) == 1:
        import torch.distributed as dist

        part = (dist.get_rank(opt._replicas), dist.get_world_size(opt._replicas))
        division = replica_division(
            resolve_cost_model(opt.cost_model, p.device.type), key, global_shapes[0], part[1], opt.overlap
        )
    if division in ("gram", "rows"):
        # a Gram map of a replicated matrix: each replica sums a slice of the rows, the
        # d x d sums are all-reduced, every replica finishes the map on all rows
        sums, divide = (ShardSum(opt._replicas, global_shapes[0][-2], part, divide=True), None), False
        if division == "rows":
            # cheaper still: each replica maps its rows completely into its weights and broadcasts them
            buckets[BucketKey(key, tuple(global_shapes[0][-2:]), ROWS, (id(opt._replicas),))].append(
                WorkItem(
                    layout.to_work_list(direction)[0],
                    work_views(p, layout)[0],
                    times(shape_factor(group, *global_shapes[0][-2:])),
                    group,
                    sums,
                )
            )
            return
    seconds: list = [None] * len(global_shapes)
    if rule.row_moments:
        weight = okf * (1.0 - group["beta2"])
        seconds = [(v, weight) for v in row_moment_views(layout, tuple(p.shape), local(state[ROW_MOMENT]))]
    for w, pw, gshape, second in zip(layout.to_work_list(direction), work_views(p, layout), global_shapes, seconds):
        if sums is None and w.numel() == 0:
            continue  # an empty block of a stack of experts: nothing to map, nothing sent
        coef = times(shape_factor(group, *gshape[-2:]))
        if sums is not None:
            # one bucket per (global shape, process groups): every rank forms the same buckets
            groups = tuple(id(r.group) if r is not None else None for r in sums)
            buckets[BucketKey(key, tuple(gshape[-2:]), REDUCE, groups)].append(WorkItem(w, pw, coef, group, sums))
        else:
            buckets[BucketKey(key, tuple(w.shape[-2:]), DIVIDED if divide else LOCAL_MODE)].append(
                WorkItem(w, pw, coef, group, second=second)
            )


def lazy_rows(direction: torch.Tensor, grad: torch.Tensor, layout: Layout, how: Plan, name: str) -> torch.Tensor:
    """A copy of the direction whose work-matrix rows are zero where this step's gradient
    row is zero (``lazy``): those rows get no update from any matrix map.

    An embedding's gradient is nonzero only in the rows of the batch's tokens. Row
    normalisation (RowNormM, HybridPolarGradM) gives every nonzero momentum row a step of
    the same size, so without this a token keeps moving by a full step in the direction
    of its last gradients on every step after it was last seen, for as long as its
    momentum decays (normalisation undoes the decay); the share of such rows grows with
    the vocabulary. The mask is a function of the gradient's row norms, so it commutes
    with row permutations and with orthogonal maps of the columns (the LPRO group).
    """
    if how.cols:
        # this rank holds only some entries of a work row: its gradient cannot tell
        raise ValueError(
            f"parameter {name!r}: lazy=True needs whole work rows on every rank, but its "
            f"placements split the work matrices' columns (layout {layout!r}); shard the "
            "rows instead (layout 'row' with Shard(0))"
        )
    out = direction.clone()
    for w, g in zip(layout.to_work_list(out), layout.to_work_list(grad)):
        w.mul_(g.ne(0).any(dim=-1, keepdim=True))
    return out


def centre_in_place(direction: torch.Tensor, layout: Layout, okf: torch.Tensor, key: MapKey) -> MapKey:
    """Centre the direction's work matrices in place (``D <- Pi D``) and return the key
    of maps that take them as already centred.

    A centred map sees only ``Pi D`` and ``Pi`` is linear, so it commutes with the
    momentum average: storing ``Pi M`` instead of ``M`` leaves every update unchanged
    (up to rounding) and spares the map a full-size centred copy (for an LM head the
    size of the vocabulary matrix). A skipped parameter (``okf = 0``) is left as is.
    """
    for w in layout.to_work_list(direction):
        w.sub_(w.mean(dim=-2, keepdim=True).mul_(okf))
    return precentred(key)


def work_views(p: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The parameter's work matrices as views: the update is added to them in place
    (every layout only reshapes, transposes and slices; checked when the group is built).
    The step runs under ``no_grad``, where a parameter's views are written in place as is."""
    return layout.to_work_list(p)


def adamw_steps(group: dict, lr, params: list, states: list, okfs: list) -> None:
    """AdamW with bias correction and decoupled decay, with torch's foreach kernels (a
    complex parameter, its gradient and moments as their real views)."""
    buckets: dict[tuple, list] = defaultdict(list)
    for k, (p, st) in enumerate(zip(params, states)):
        w, m, v = real(local(p)), real(local(st["exp_avg"])), real(local(st["exp_avg_sq"]))
        buckets[(w.dtype, w.device, m.dtype)].append((w, (m, v, st["step"]), okfs[k], real(local(p.grad))))
    for (_, _, s_dtype), items in buckets.items():
        adamw_(
            [w for w, _, _, _ in items],
            sanitize_all([g for _, _, _, g in items], [s_dtype] * len(items)),
            [m for _, (m, _, _), _, _ in items],
            [v for _, (_, v, _), _, _ in items],
            [step for _, (_, _, step), _, _ in items],
            [okf.to(s_dtype) for _, _, okf, _ in items],
            lr,
            group["betas"],
            group["adam_eps"],
            group["weight_decay"],
        )
