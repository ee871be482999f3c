"""Buckets: the parameters a step updates together, their state stacked, made once.

A :class:`Part` is the parameters of one param group that share a stored shape, layout,
dtype and device. Its state lives in one stacked tensor per entry (the momentum
``(B, *shape)``, or AdamW's two moments and step counters, and the skip counters
``(B,)``); each parameter's ``optimizer.state`` entries are views of those stacks, so
``state_dict()``, checkpoints and a user's own look at the state see one tensor per
parameter as always. A :class:`Bucket` is the parts whose work matrices share one map
(equal map settings and work-matrix shape): the map runs on all of their matrices in one
batched call.

A step then dispatches a fixed number of operators per part and bucket, however many
parameters they hold (``docs/step.md`` has the counts):

- per part: the gradients in (one ``stack``, and a cast where the state is wider), the
  finite flags (one ``aminmax`` over each member, two comparisons), the skip counters,
  sanitising (one ``nan_to_num_`` on the stack, never on ``.grad``), the momentum (one
  ``lerp_``; Nesterov one more), the decay (one foreach multiply), the centring of
  quotient maps;
- per bucket: the map on the stacked work matrices, the guard of each matrix's update
  (its small factors checked and cleaned), and per part the update, materialised once
  with the learning rate, the shape factor and the skip flags folded in, and added to the
  weights with one foreach add (a part of one parameter adds its factored update straight
  into the weights' work views, no full-size update formed).

Parameters that cannot be stacked this way (sharded or divided ones, ``lazy`` rows,
multi-block layouts, ``nonfinite="raise"``) keep the per-parameter path of the engine.
:func:`make_buckets` builds parts and buckets from the parameters that have state (or a
gradient now); the engine makes them again when a group is added, a state dict is
loaded, or a state entry no longer is the view it handed out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import maps
from ..layouts import Layout
from .apply import GRAD_LIMIT, _add_
from .rules import MapKey, factored_map, map_key, precentred, shape_factor

__all__ = ["Part", "Bucket", "Buckets", "make_buckets"]

#: The state entries a part stacks, per rule kind.
MOMENTUM_KEYS = ("momentum_buffer",)
ADAMW_KEYS = ("exp_avg", "exp_avg_sq")


#: AdamW parameters of at most this many entries share one flat part whatever their
#: shapes (norm weights, biases); larger ones are stacked by shape.
FLAT_MAX = 2**16


class Part:
    """Parameters of one group on one device in one dtype, and their state as stacks
    (:attr:`stacks`): ``state[p][key]`` is member ``k``'s view of ``stacks[key]``.

    Members of a matrix rule (and large AdamW parameters) share their stored shape and
    layout, and a stack is ``(B, *shape)``; ``flat`` AdamW parts hold small parameters of
    any shapes end to end in ``(sum of sizes,)`` stacks."""

    def __init__(
        self,
        group: dict,
        members: list[int],
        layout: Layout,
        state: dict,
        state_dtype: torch.dtype,
        flat: bool = False,
        index: int = 0,
    ):
        self.group = group
        self.index = index  # the group's position in param_groups (its learning rate's)
        self.params: list[torch.Tensor] = [group["params"][j] for j in members]
        self.names: list[str] = [group["names"][j] for j in members]
        self.layout = layout
        self.flat = flat
        first = self.params[0]
        self.shape = tuple(first.shape)
        self.dtype, self.device, self.state_dtype = first.dtype, first.device, state_dtype
        self.adamw = group["rule"] == "adamw"
        work = layout.work_shapes(self.shape)[0] if not self.adamw else (1, *self.shape)
        self.work_shape = tuple(work)  # one member's work tensor
        self.per_member = 1
        for size in self.work_shape[:-2]:
            self.per_member *= size
        self.factor = 1.0 if self.adamw else shape_factor(group, *self.work_shape[-2:])
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        self._sizes = torch.tensor(self.sizes, device=self.device) if flat else None
        keys = ADAMW_KEYS if self.adamw else MOMENTUM_KEYS
        self.stacks: dict[str, torch.Tensor] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        for key in keys:
            self.stacks[key] = self._stack(state, key, state_dtype)
            self.views[key] = self.members_of(self.stacks[key])
        counters = ("nonfinite", "step") if self.adamw else ("nonfinite",)
        for key in counters:
            self.stacks[key] = self._stack(state, key, torch.float32, scalar=True)
            self.views[key] = list(self.stacks[key].unbind(0))
        # hand out the views: state[p][key] is member k's view of stacks[key]
        for k, p in enumerate(self.params):
            entry = state[p]
            for key, views in self.views.items():
                entry[key] = views[k]
        self._zeros: dict[torch.Size, torch.Tensor] = {}  # the gradient of a member that has none
        self._masks: dict[tuple[bool, ...], torch.Tensor] = {}
        self.scratch: torch.Tensor | None = None  # the gradients in, see :class:`Buckets`
        self._scratch_members: list[torch.Tensor] = []

    def members_of(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Each member's view of a stack ``t`` (made once per stack; a step uses them as they are)."""
        if not self.flat:
            return list(t.unbind(0))
        out, at = [], 0
        for p, n in zip(self.params, self.sizes):
            out.append(t.narrow(0, at, n).view(p.shape))
            at += n
        return out

    def use_scratch(self, flat: torch.Tensor) -> None:
        """Take the gradients in through ``flat`` (a slice of the buckets' shared buffer)."""
        self.scratch = flat if self.flat else flat.view(len(self.params), *self.shape)
        self._scratch_members = self.members_of(self.scratch)

    def _stack(self, state: dict, key: str, dtype: torch.dtype, scalar: bool = False) -> torch.Tensor:
        """The stack of ``key``: the members' existing entries (kept at their dtype), else zeros."""
        found = [state[p].get(key) if p in state else None for p in self.params]
        count = len(self.params)
        if all(t is None for t in found):
            shape = (count,) if scalar else (self.numel,) if self.flat else (count, *self.shape)
            return torch.zeros(shape, dtype=dtype, device=self.device)
        have = next(t for t in found if t is not None)
        filled = [
            t.to(self.device)
            if t is not None
            else torch.zeros(() if scalar else p.shape, dtype=have.dtype, device=self.device)
            for p, t in zip(self.params, found)
        ]
        if self.flat and not scalar:
            return torch.cat([t.reshape(-1) for t in filled])
        return torch.stack(filled)

    def intact(self, state: dict) -> bool:
        """Whether every member's state entries still are the views this part handed out."""
        for k, p in enumerate(self.params):
            entry = state.get(p)
            if entry is None:
                return False
            for key, views in self.views.items():
                if entry.get(key) is not views[k]:
                    return False
        return True

    # --------------------------------------------------------------- per step
    def gradients(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The members' gradients stacked in the state dtype and sanitised (NaN and Inf
        set to 0; ``.grad`` itself is never written), their finite flags (``(B,)`` bool:
        free of NaN and Inf with every entry within ``GRAD_LIMIT``, and present), and the
        flags reported for the step (True for a member that has no gradient this step)."""
        grads: list[torch.Tensor] = []
        missing = False
        for p, name in zip(self.params, self.names):
            g = p.grad
            if g is None:
                missing = True
                g = self._zeros.get(p.shape)
                if g is None:
                    g = self._zeros[p.shape] = torch.zeros(p.shape, dtype=self.dtype, device=self.device)
            elif g.is_sparse:
                raise ValueError(f"parameter {name!r}: sparse gradients are not supported")
            grads.append(g)
        stacked = self.scratch
        assert stacked is not None
        single = len(grads) == 1 and not self.flat and self.dtype == self.state_dtype
        if single:
            # one gradient: flags from it, then copied and sanitised in one pass below
            seen = grads[0].reshape(1, -1)
        elif self.dtype == self.state_dtype and not self.flat:
            seen = torch.stack(grads, out=stacked).view(len(grads), -1)
        else:
            torch._foreach_copy_(self._scratch_members, grads)
            seen = stacked if self.flat else stacked.view(len(grads), -1)
        if self.flat:
            # a sum carries any NaN or Inf; the largest magnitude gives the bound
            sums = torch.stack(torch._foreach_norm(self._scratch_members, 1))
            largest = torch.stack(torch._foreach_norm(self._scratch_members, float("inf")))
            finite = _finite(sums) & (largest <= GRAD_LIMIT)
        else:
            # two reductions (aminmax along a dimension is many times slower on a CPU)
            finite = (seen.amin(dim=1) >= -GRAD_LIMIT) & (seen.amax(dim=1) <= GRAD_LIMIT)  # NaN fails both
        if missing:
            present = self._mask(tuple(p.grad is not None for p in self.params))
            ok, bad, reported = finite & present, present & ~finite, ~(present & ~finite)
        else:
            ok, bad, reported = finite, ~finite, finite
        self.stacks["nonfinite"].add_(bad)
        if single:
            torch.nan_to_num(grads[0], nan=0.0, posinf=0.0, neginf=0.0, out=self._scratch_members[0])
        else:
            torch.nan_to_num_(stacked, nan=0.0, posinf=0.0, neginf=0.0)
        return stacked, ok, reported

    def _mask(self, pattern: tuple[bool, ...]) -> torch.Tensor:
        found = self._masks.get(pattern)
        if found is None:
            found = self._masks[pattern] = torch.tensor(pattern, dtype=torch.bool, device=self.device)
        return found

    def _lead(self, t: torch.Tensor, ndim: int) -> torch.Tensor:
        """``(B,)`` ``t`` (one value per member) spread over a stack of ``ndim`` dimensions:
        a broadcasting view, or for a flat part each value repeated over its member's entries."""
        if self.flat:
            return torch.repeat_interleave(t, self._sizes, output_size=self.numel)  # type: ignore[arg-type]
        return t.view(-1, *([1] * (ndim - 1)))

    def decay(self, lr: torch.Tensor, okl: torch.Tensor) -> None:
        """Decoupled weight decay ``W <- (1 - lr wd) W`` of every member (exactly 1 where skipped)."""
        wd = self.group["weight_decay"]
        if wd:
            torch._foreach_mul_(self.params, list(torch.unbind(1.0 - (lr * wd) * okl, 0)))

    def direction(self, grads: torch.Tensor, okf: torch.Tensor) -> torch.Tensor:
        """EMA momentum ``M <- beta M + (1 - beta) G`` in place (weight 0 where skipped); the
        direction ``M``, or with Nesterov ``beta M + (1 - beta) G`` (written over ``grads``)."""
        beta = self.group["beta"]
        buf = self.stacks["momentum_buffer"]
        buf.lerp_(grads, self._lead(okf * (1.0 - beta), buf.ndim))
        if self.group["nesterov"]:
            return grads.lerp_(buf, beta)
        return buf

    def work(self, direction: torch.Tensor) -> torch.Tensor:
        """The direction's work matrices, ``(B * per_member, m, n)`` (a view where the layout allows)."""
        w = self.layout.stacked_to_work(direction)[0]
        return w.reshape(-1, *self.work_shape[-2:])

    def centre(self, direction: torch.Tensor, okf: torch.Tensor) -> None:
        """``D <- Pi D`` in place on every work matrix (the quotient maps' input; see the
        engine's ``_centre_in_place``); a skipped member is left as it is."""
        w = self.layout.stacked_to_work(direction)[0]
        w.sub_(w.mean(dim=-2, keepdim=True).mul_(self._lead(okf, w.ndim)))

    def add(self, f: maps.Factored, coef: torch.Tensor) -> None:
        """Add ``coef * U`` (``coef``: one per work matrix, skips and learning rate folded
        in) to the members' weights."""
        dtype = f.x.dtype
        c = coef.to(dtype).view(-1, 1, 1)
        if len(self.params) == 1:
            # one parameter: the factored update goes straight into its work views
            view = self.layout.to_work_list(self.params[0].detach())[0]
            lead = view.shape[:-2]
            _add_(
                view,
                _pieces(f, lambda t: t.view(*lead, *t.shape[-2:])),
                c.view(*lead, 1, 1) if lead else c.view(()),
            )
            return
        u = maps.materialize(_scaled(f, c))
        if u.dtype != self.dtype:
            u = u.to(self.dtype)
        stored = self.layout.stacked_from_work([u.view(len(self.params), *self.work_shape)])
        torch._foreach_add_(self.params, list(stored.unbind(0)))

    def adamw_step(self, grads: torch.Tensor, okf: torch.Tensor, lr: torch.Tensor) -> None:
        """AdamW with bias correction and decoupled decay on the stacked moments (the
        engine's ``adamw`` rule; see :func:`~.apply.adamw_`): a skipped member keeps its
        step count, moments and weights."""
        b1, b2 = self.group["betas"]
        eps = self.group["adam_eps"]
        m, v, steps = self.stacks["exp_avg"], self.stacks["exp_avg_sq"], self.stacks["step"]
        steps.add_(okf)
        m.lerp_(grads, self._lead(okf * (1.0 - b1), m.ndim))
        # a skipped gradient may hold entries whose square overflows: squares are capped
        sq = torch.mul(grads, grads, out=grads).clamp_(max=torch.finfo(grads.dtype).max)
        v.lerp_(sq, self._lead(okf * (1.0 - b2), v.ndim))
        denom = torch.sqrt(v, out=sq)
        counts = steps.clamp(min=1.0).to(m.dtype)
        bc1 = 1.0 - torch.pow(b1, counts)
        c = torch.sqrt(1.0 - torch.pow(b2, counts))
        # m / (sqrt(v / bc2) + eps) * (-lr ok / bc1) = m / ((sqrt(v) + c eps) / (-lr ok c / bc1)):
        # a skipped step divides by 0 (m / inf = 0)
        denom.add_(self._lead(c * eps, denom.ndim))
        okl = okf.to(lr.dtype)
        size = (okl * -lr) * c.to(lr.dtype) / bc1.to(lr.dtype)
        denom.div_(self._lead(size.to(denom.dtype), denom.ndim))
        self.decay(lr, okl)
        if self.dtype == m.dtype:
            torch._foreach_addcdiv_(self.params, self.views["exp_avg"], self._scratch_members)
        else:
            torch._foreach_add_(self.params, self.members_of(torch.div(m, denom).to(self.dtype)))


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


class Bucket:
    """Parts whose work matrices share one map: equal map settings (:class:`MapKey`) and
    work-matrix shape, on one device in one compute dtype."""

    def __init__(self, key: MapKey, parts: list[Part]):
        self.key = key
        self.parts = parts
        self.eta = parts[0].group["eta"]


class Buckets:
    """Every part and bucket of an optimizer, and the parameters they cover.

    The gradients come in through one buffer per device and state dtype, as large as the
    largest bucket's gradients (every bucket reads its own and is done with them before
    the next begins): sanitised there, never in ``.grad``, and nothing of the gradients'
    size is allocated after the first step."""

    def __init__(self, matrix: list[Bucket], adamw: list[Part]):
        self.matrix = matrix
        self.adamw = adamw
        self.covered = {id(p) for b in matrix for part in b.parts for p in part.params}
        self.covered |= {id(p) for part in adamw for p in part.params}
        units = [b.parts for b in matrix] + [[part] for part in adamw]
        sizes: dict[tuple, int] = defaultdict(int)
        for parts in units:
            where = (parts[0].device, parts[0].state_dtype)
            sizes[where] = max(sizes[where], sum(part.numel for part in parts))
        self.scratch = {where: torch.empty(size, dtype=where[1], device=where[0]) for where, size in sizes.items()}
        for parts in units:
            flat, at = self.scratch[(parts[0].device, parts[0].state_dtype)], 0
            for part in parts:
                part.use_scratch(flat.narrow(0, at, part.numel))
                at += part.numel

    @property
    def parts(self) -> list[Part]:
        return [part for b in self.matrix for part in b.parts] + self.adamw

    def intact(self, state: dict) -> bool:
        return all(part.intact(state) for part in self.parts)


def make_buckets(
    groups: Iterable[tuple[dict, list[int]]], state: dict, state_dtype: Callable[[torch.Tensor], torch.dtype]
) -> Buckets:
    """Parts and buckets of ``(group, members)`` pairs, one per param group in order (members: positions of the group's
    parameters that a part may stack), adopting any state the members already have."""
    by_part: dict[tuple, list[int]] = defaultdict(list)
    owners: dict[tuple, tuple[int, dict]] = {}
    for index, (group, members) in enumerate(groups):
        for j in members:
            p = group["params"][j]
            layout = group["layouts"][j]
            flat = group["rule"] == "adamw" and p.numel() <= FLAT_MAX
            shape = None if flat else tuple(p.shape)
            key = (id(group), shape, layout if not flat else None, p.dtype, p.device, state_dtype(p), flat)
            by_part[key].append(j)
            owners[key] = (index, group)
    matrix: dict[tuple, list[Part]] = defaultdict(list)
    adamw: list[Part] = []
    for key, members in by_part.items():
        (index, group), sdtype, flat = owners[key], key[5], key[6]
        part = Part(group, members, group["layouts"][members[0]], state, sdtype, flat, index)
        if part.adamw:
            adamw.append(part)
            continue
        mkey = map_key(group)
        if group["center"] and mkey.rule != "spectral":
            mkey = precentred(mkey)  # the part centres its direction in place
        matrix[(mkey, part.work_shape[-2:], part.device, sdtype)].append(part)
    return Buckets([Bucket(k[0], parts) for k, parts in matrix.items()], adamw)


def _finite(t: torch.Tensor) -> torch.Tensor:
    """``t.isfinite()`` in two operators (``t - t`` is 0 exactly where ``t`` is finite)."""
    return (t - t) == 0


def guard(f: maps.Factored) -> tuple[maps.Factored, torch.Tensor]:
    """``f`` (a batch of ``N`` updates) with its non-finite entries zeroed, and each update's
    finite flag (``(N,)`` bool), read from its small factors, or from the update itself when
    it is given whole (then cleaned in place: it is always a fresh tensor). The batched
    form of :func:`~.apply._guarded`."""
    names = [k for k in ("row", "left", "right", "shift") if getattr(f, k) is not None]
    checked = [getattr(f, k) for k in names] or [f.x]
    ok: Any = None
    for t in checked:
        flag = _finite(t.sum(dim=(-2, -1)))  # a sum carries any NaN or Inf (one pass)
        ok = flag if ok is None else ok & flag
    if names:
        if f.low is not None:
            torch.nan_to_num_(f.low, nan=0.0, posinf=0.0, neginf=0.0)
        return f._replace(**{k: torch.nan_to_num(getattr(f, k), nan=0.0, posinf=0.0, neginf=0.0) for k in names}), ok
    torch.nan_to_num_(f.x, nan=0.0, posinf=0.0, neginf=0.0)
    return f, ok


def run_bucket(
    bucket: Bucket,
    lrs: list[torch.Tensor],
    flags: list,
    skips: torch.Tensor,
    map_fn: Callable[..., maps.Factored] = factored_map,
) -> None:
    """One step of a bucket: each part's gradients, flags, momentum, decay (and centring),
    the map (``map_fn``, :func:`~.rules.factored_map`) on all of their work matrices at
    once, the guard, and each part's update; ``flags`` gains each part's names and finite
    flags, ``skips`` counts the updates the guard refused."""
    works, coefs = [], []
    for part in bucket.parts:
        lr = lrs[part.index]
        grads, ok, reported = part.gradients()
        flags.append((part.names, reported))
        okf = ok.to(part.state_dtype)
        okl = okf.to(lr.dtype)
        part.decay(lr, okl)
        direction = part.direction(grads, okf)
        if bucket.key.center == "precentred":
            part.centre(direction, okf)
        works.append(part.work(direction))
        coef = (lr * -part.factor) * okl
        coefs.append(coef.repeat_interleave(part.per_member) if part.per_member > 1 else coef)
    x = works[0] if len(works) == 1 else torch.cat(works)
    f = map_fn(bucket.key, bucket.eta, x)
    f, ok = guard(f)
    coef = coefs[0] if len(coefs) == 1 else torch.cat(coefs)
    skips.add_((~ok & (coef != 0)).sum())
    coef = coef * ok
    at = 0
    for part, w in zip(bucket.parts, works):
        n = w.shape[0]
        piece = f if len(works) == 1 else _pieces(f, lambda t: t.narrow(0, at, n))
        part.add(piece, coef.narrow(0, at, n))
        at += n


def run_adamw(part: Part, lr: torch.Tensor, flags: list) -> None:
    """One AdamW step of a part."""
    grads, ok, reported = part.gradients()
    flags.append((part.names, reported))
    part.adamw_step(grads, ok.to(part.state_dtype), lr)
