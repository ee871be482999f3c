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
parameters they hold (``docs/step.md`` has the counts). It runs in three stages:

- in, eager (:meth:`Part.take`): the gradients into a buffer made once (one ``stack``, or
  one foreach copy where the state is wider or the part flat; never into ``.grad``);
- the core (:func:`bucket_core`, :func:`adamw_core`), on stacks alone, what
  ``compile=`` compiles once per kind of bucket: the finite flags and the skip counters
  (``equiopt::grad_flags``), sanitising, the momentum and Nesterov's direction, written
  into the part's place in the map's input (``equiopt::momentum_stage``; :mod:`.fused`;
  a part whose work is a transpose of its stack or that is centred in place takes a
  minimum and a maximum, a ``nan_to_num``, a ``lerp_`` and Nesterov's ``lerp`` instead),
  the centring of quotient maps, the map on every work
  matrix of the bucket at once (its input written over the bucket's spent gradients), the
  guard of each matrix's update (its small factors checked and cleaned), and each part's
  update materialised once, into that buffer too, with the learning rate, the shape factor
  and the skip flags folded in (a part of one parameter adds its factored update straight
  into the weights' work views: no full-size update formed); the map's own working set is
  then all that a step allocates;
- out, eager (:meth:`Part.finish`): the decay and the update of the members, one
  ``equiopt::decay_add_`` (a foreach multiply and a foreach add where the update is no
  contiguous stack).

Parameters that cannot be stacked this way (sharded or divided ones, ``lazy`` rows,
multi-block layouts, ``nonfinite="raise"``) keep the per-parameter path of the engine.
:func:`make_buckets` builds parts and buckets from the parameters that have state (or a
gradient now): at construction with ``eager_state``, at ``load_state_dict``, else at the
first step; the engine makes them again when a group is added, a state dict is loaded, a
parameter gets its first gradient, a group's rule or map settings change, or a state
entry no longer is the view it handed out.
"""

from __future__ import annotations

import types
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from .. import maps
from ..layouts import Layout
from .apply import GRAD_LIMIT, _add_
from .fields import POLAR_RULES
from .fused import ops as fused
from .row_moments import ROW_MOMENT, row_moment_shape, row_moment_views
from .rules import PRECENTRED, MapKey, factored_map, map_key, precentred, shape_factor

__all__ = [
    "Part",
    "Spec",
    "Bucket",
    "Buckets",
    "Cores",
    "make_buckets",
    "bucket_core",
    "adamw_core",
    "run_bucket",
    "run_adamw",
    "ROW_MOMENT",
    "row_moment_shape",
    "row_moment_views",
]

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
        self.work_is_view = self.adamw or _work_is_view(layout, self.shape)
        self.per_member = 1
        for size in self.work_shape[:-2]:
            self.per_member *= size
        self.structure = _structure(group)  # what the part was built for (checked each step)
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        self._sizes = torch.tensor(self.sizes, device=self.device) if flat else None
        keys = ADAMW_KEYS if self.adamw else MOMENTUM_KEYS
        self.stacks: dict[str, torch.Tensor] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        for key in keys:
            self.stacks[key] = self._stack(state, key, state_dtype)
            self.views[key] = self.members_of(self.stacks[key])
        if group["rule"] == "normuon":
            entry = row_moment_shape(layout, self.shape)
            self.stacks[ROW_MOMENT] = self._stack(state, ROW_MOMENT, state_dtype, entry=entry)
            self.views[ROW_MOMENT] = list(self.stacks[ROW_MOMENT].unbind(0))
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
        self._scalars: tuple | None = None
        self._spec: Spec | None = None
        self._masks: dict[tuple[bool, ...], torch.Tensor] = {}
        self.scratch: torch.Tensor | None = None  # the gradients in, see :class:`Buckets`
        self._scratch_members: list[torch.Tensor] = []
        self._update_members: list[torch.Tensor] = []  # a matrix rule's update, in the scratch
        self.place: torch.Tensor  # a matrix rule's work matrices in the buffer (:meth:`use_scratch`)
        self.update_in_place = False
        self._update_stack: torch.Tensor | None = None  # the update in the buffer, as a stack
        # the decay and the update add in one operator where every weight is contiguous
        self._fused_finish = not self.adamw and not flat and all(p.is_contiguous() for p in self.params)

    @property
    def spec(self) -> Spec:
        """The part's :class:`Spec` from its group's settings as they are now (a schedule may
        move ``beta`` or ``weight_decay`` between steps; the stacks stay)."""
        g = self.group
        scalars = (
            g.get("beta"),
            g.get("nesterov"),
            g["weight_decay"],
            tuple(g["betas"]),
            g["adam_eps"],
            g.get("lr_scale"),
            g.get("beta2"),
        )
        if self._spec is None or scalars != self._scalars:
            self._scalars = scalars
            self._spec = Spec(
                layout=None if self.flat else self.layout,
                members=len(self.params),
                shape=self.shape,
                work_shape=self.work_shape,
                per_member=self.per_member,
                factor=1.0 if self.adamw else shape_factor(g, *self.work_shape[-2:]),
                beta=float(g.get("beta") or 0.0),
                nesterov=bool(g.get("nesterov")),
                weight_decay=float(g["weight_decay"]),
                single=len(self.params) == 1 and not self.flat and self.dtype == self.state_dtype,
                dtype=self.dtype,
                flat=self.flat,
                numel=self.numel,
                betas=(float(g["betas"][0]), float(g["betas"][1])),
                adam_eps=float(g["adam_eps"]),
                beta2=float(g.get("beta2") or 0.0),
                work_is_view=self.work_is_view,
                update_in_place=self.update_in_place,
            )
        return self._spec

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
        """Take the gradients in through ``flat`` (a slice of the buckets' shared buffer); a
        matrix rule's update comes back there too (:func:`bucket_core`), in work layout."""
        self.scratch = flat if self.flat else flat.view(len(self.params), *self.shape)
        self._scratch_members = self.members_of(self.scratch)
        if not self.adamw:
            work = flat.view(len(self.params), *self.work_shape)
            self.place = flat.view(-1, *self.work_shape[-2:])  # its work matrices, in the bucket's map input
            stored = self.layout.stacked_from_work([work])
            # the update is added from the place where the parameters have the buffer's dtype and
            # the stored layout is a view of it (an interleaved gate/up layout, say, builds a new
            # tensor instead)
            self.update_in_place = (
                self.dtype == flat.dtype and stored.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            )
            self._update_members = self.members_of(stored) if self.update_in_place else []
            self._update_stack = stored if self.update_in_place and stored.is_contiguous() else None
            self._spec = None

    def _stack(
        self, state: dict, key: str, dtype: torch.dtype, scalar: bool = False, entry: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The stack of ``key``: the members' existing entries (kept at their dtype), else zeros.
        ``entry``: one member's entry shape where it is not the parameter's."""
        found = [state[p].get(key) if p in state else None for p in self.params]
        count = len(self.params)
        if all(t is None for t in found):
            if entry is not None:
                return torch.zeros((count, *entry), dtype=dtype, device=self.device)
            shape = (count,) if scalar else (self.numel,) if self.flat else (count, *self.shape)
            return torch.zeros(shape, dtype=dtype, device=self.device)
        have = next(t for t in found if t is not None)
        filled = [
            t.to(self.device)
            if t is not None
            else torch.zeros(
                () if scalar else entry if entry is not None else p.shape, dtype=have.dtype, device=self.device
            )
            for p, t in zip(self.params, found)
        ]
        if self.flat and not scalar:
            return torch.cat([t.reshape(-1) for t in filled])
        return torch.stack(filled)

    def intact(self, state: dict) -> bool:
        """Whether the part still holds: its group's rule and map settings are the ones it was
        built for, and every member's state entries are the views it handed out."""
        if _structure(self.group) != self.structure:
            return False
        for k, p in enumerate(self.params):
            entry = state.get(p)
            if entry is None:
                return False
            for key, views in self.views.items():
                if entry.get(key) is not views[k]:
                    return False
        return True

    # --------------------------------------------------------------- per step
    def take(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The members' gradients in (eager, before the part's core): ``(source, present,
        finite)``. ``source`` is the one gradient of a single-member part, else the stack
        of them in :attr:`scratch` (one ``stack``, or one foreach copy where the state is
        wider or the part flat); ``present`` masks members without a gradient this step
        (None: all have one); ``finite`` are a flat part's finite flags (two foreach norms),
        None where the core takes them. ``.grad`` itself is never written."""
        grads: list[torch.Tensor] = []
        missing = False
        for p, name in zip(self.params, self.names):
            g = p.grad
            if g is None:
                missing = True
                g = self._zeros.get(p.shape)
                if g is None:
                    g = self._zeros[p.shape] = torch.zeros(p.shape, dtype=self.dtype, device=self.device)
            elif g.layout != torch.strided:  # (the step refuses these first, by rule and name)
                raise ValueError(f"parameter {name!r}: sparse gradients are not supported")
            grads.append(g)
        present = self._mask(tuple(p.grad is not None for p in self.params)) if missing else None
        scratch = self.stacked()
        if self.spec.single:
            return grads[0], present, None
        if self.dtype == self.state_dtype and not self.flat:
            return torch.stack(grads, out=scratch), present, None
        torch._foreach_copy_(self._scratch_members, grads)
        if not self.flat:
            return scratch, present, None
        # a sum carries any NaN or Inf; the largest magnitude gives the bound
        sums = torch.stack(torch._foreach_norm(self._scratch_members, 1))
        largest = torch.stack(torch._foreach_norm(self._scratch_members, float("inf")))
        return scratch, present, _finite(sums) & (largest <= GRAD_LIMIT)

    def _mask(self, pattern: tuple[bool, ...]) -> torch.Tensor:
        found = self._masks.get(pattern)
        if found is None:
            found = self._masks[pattern] = torch.tensor(pattern, dtype=torch.bool, device=self.device)
        return found

    def finish(self, update: torch.Tensor | None, okl: torch.Tensor, lr: torch.Tensor) -> None:
        """After the core (eager): the decay ``W <- (1 - lr wd) W`` of every member (exactly 1
        where skipped) and the update's foreach add; a single-member part's core did both."""
        if self.spec.single and not self.adamw:
            return
        wd = self.group["weight_decay"]
        stack = self._update_stack if update is None else update
        if self._fused_finish and stack is not None and stack.is_contiguous():
            fused.decay_add_(self.params, stack, 1.0 - (lr * wd) * okl if wd else None)
            return
        if wd:
            torch._foreach_mul_(self.params, list(torch.unbind(1.0 - (lr * wd) * okl, 0)))
        if self.adamw and update is None:
            torch._foreach_addcdiv_(self.params, self.views["exp_avg"], self._scratch_members)
        elif update is not None:
            torch._foreach_add_(self.params, self.members_of(update))
        else:  # the core left the update in the scratch
            torch._foreach_add_(self.params, self._update_members)

    def stacked(self) -> torch.Tensor:
        """The buffer the gradients come in through (made with the buckets)."""
        assert self.scratch is not None
        return self.scratch

    def core_tensors(self) -> tuple:
        """The state tensors the part's core updates in place."""
        if self.adamw:
            return (self.stacks["exp_avg"], self.stacks["exp_avg_sq"], self.stacks["step"], self.stacks["nonfinite"])
        extra = (self.stacks[ROW_MOMENT],) if ROW_MOMENT in self.stacks else ()
        return (self.stacks["momentum_buffer"], self.stacks["nonfinite"], *extra)


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


def _work_is_view(layout: Layout, shape: tuple[int, ...]) -> bool:
    """Whether a contiguous stack's work tensor is the stack itself reshaped: the same memory
    in the same order (a layout that splits heads along rows), not a transposed view."""
    stack = torch.empty((2, *shape), device="meta")
    works = layout.stacked_to_work(stack)
    if len(works) != 1:
        return False
    work = works[0]
    return work.is_contiguous() and work.storage_offset() == 0 and (work is stack or work._base is stack)


def _lead(spec: Spec, t: torch.Tensor, ndim: int, sizes: torch.Tensor | None = None) -> torch.Tensor:
    """``(B,)`` ``t`` (one value per member) spread over a stack of ``ndim`` dimensions: a
    broadcasting view, or for a flat part each value repeated over its member's entries."""
    if spec.flat:
        return torch.repeat_interleave(t, sizes, output_size=spec.numel)  # type: ignore[arg-type]
    return t.view(-1, *([1] * (ndim - 1)))


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


class Bucket:
    """Parts whose work matrices share one map: equal map settings (:class:`MapKey`) and
    work-matrix shape, on one device in one compute dtype."""

    def __init__(self, key: MapKey, parts: list[Part]):
        self.key = key
        self.parts = parts
        self.eta = parts[0].group["eta"]
        self.scratch: torch.Tensor | None = None  # its parts' places end to end (:class:`Buckets`)


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
        for b in matrix:
            flat = self.scratch[(b.parts[0].device, b.parts[0].state_dtype)]
            b.scratch = flat.narrow(0, 0, sum(part.numel for part in b.parts)).view(-1, *b.parts[0].work_shape[-2:])

    @property
    def parts(self) -> list[Part]:
        return [part for b in self.matrix for part in b.parts] + self.adamw

    def intact(self, state: dict) -> bool:
        return all(part.intact(state) for part in self.parts)


def _structure(group: dict) -> tuple:
    """The settings a part's stacking and its bucket depend on (changing one makes the buckets again)."""
    rule = group["rule"]
    return (rule, group["nonfinite"], group["lazy"], map_key(group) if rule != "adamw" else None)


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
        if group["center"] and mkey.rule not in POLAR_RULES:
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


def _side_by_side(
    places: list[torch.Tensor], specs: tuple[Spec, ...], works: list[torch.Tensor], placed: list[bool]
) -> None:
    """``torch.cat(works)`` without a new tensor: each part's work matrices into its place in
    the bucket's buffer (over its own spent gradients)."""
    for place, spec, w, there in zip(places, specs, works, placed):
        if not (there or (spec.nesterov and spec.work_is_view)):  # else the direction is there already
            place.copy_(w)


def _fused_prologue(key: MapKey, spec: Spec) -> bool:
    """Whether a part's flags, sanitising, momentum and direction run as the fused operators
    of :mod:`.fused`: a stack whose work matrices are the stack itself (the direction is then
    written straight into the part's place in the map's input), not centred in place."""
    return spec.work_is_view and not spec.flat and key.center != PRECENTRED


def bucket_core(
    key: MapKey,
    eta: Any,
    specs: tuple[Spec, ...],
    sources: list[torch.Tensor],
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
) -> tuple[list[torch.Tensor | None], list[torch.Tensor], list[torch.Tensor]]:
    """The tensor work of one bucket's step, on its parts' stacks alone (what is compiled,
    once per kind of bucket; no per-parameter operator): each part's flags, sanitising and
    momentum (and centring), the map (``map_fn``, :func:`~.rules.factored_map`) on every work
    matrix at once (``normuon``: then each part's row stage, :func:`~equiopt.maps.normuon_rows`,
    on its stacked row second moments ``seconds``, a skipped member's left as they were), the
    guard of each matrix's update (refusals counted in ``skips``), and each part's update with
    its learning rate, shape factor and skip flags folded in.

    ``region``: the bucket's gradient buffer as work matrices, ``places`` each part's
    (its ``scratches`` entry) in it. Once a part's momentum has taken its gradients, the
    map's input (the parts' work matrices side by side) is written there, and after the
    map each part's update: a step allocates no copy of the bucket besides the map's own.

    Returns, per part: the update as a ``(B, *shape)`` stack to add, or None where it is
    in the part's scratch (its :meth:`Part.finish` adds it from there) or, for a
    single-member part, the core applied its decay and update to ``weights[i]`` in place;
    the skip flags in the learning rates' dtype, and the flags the step reports."""
    works, coefs, okls, reported, weights2 = [], [], [], [], []
    placed = [_fused_prologue(key, spec) for spec in specs]
    for i, spec in enumerate(specs):
        buf = momenta[i]
        if placed[i]:
            # flags, sanitising, momentum and direction in two fused operators: the direction
            # lands in the part's scratch, which is its place in the map's input
            ok, flags = fused.grad_flags(sources[i], counters[i], presents[i], spec.members)
            grads = scratches[i]
        else:
            grads, ok, flags = _gradients(spec, sources[i], scratches[i], presents[i], None, counters[i])
        reported.append(flags)
        okf = ok.to(grads.dtype)
        okl = okf.to(lrs[i].dtype)
        okls.append(okl)
        weight = weights[i]
        if weight is not None and spec.weight_decay:
            weight.mul_(1.0 - (lrs[i] * spec.weight_decay) * okl[0])
        # EMA momentum M <- beta M + (1 - beta) G (weight 0 where skipped); Nesterov's direction
        # over G (in a fresh tensor where the work is a transpose, copied into the region below)
        if placed[i]:
            fused.momentum_stage(sources[i] if spec.single else None, grads, buf, ok, spec.beta, spec.nesterov)
            direction = grads
        else:
            buf.lerp_(grads, _lead(spec, okf * (1.0 - spec.beta), buf.ndim))
            if spec.nesterov:
                together = region is not None and len(specs) > 1 and not spec.work_is_view
                direction = torch.lerp(grads, buf, spec.beta) if together else grads.lerp_(buf, spec.beta)
            else:
                direction = buf
        work = spec.layout.stacked_to_work(direction)[0]  # type: ignore[union-attr]
        if key.center == PRECENTRED:
            # D <- Pi D in place (see the engine's _centre_in_place); a skipped member stays
            work.sub_(work.mean(dim=-2, keepdim=True).mul_(_lead(spec, okf, work.ndim)))
        works.append(work.reshape(-1, *spec.work_shape[-2:]))
        coef = (lrs[i] * -spec.factor) * okl
        coefs.append(coef.repeat_interleave(spec.per_member) if spec.per_member > 1 else coef)
        if seconds is not None:
            w2 = okf * (1.0 - spec.beta2)
            weights2.append((w2.repeat_interleave(spec.per_member) if spec.per_member > 1 else w2).view(-1, 1, 1))
    del direction, work  # (the loop's last: a transposed Nesterov direction is freed once placed)
    if len(works) == 1:
        x = works[0]
    elif region is None:
        x = torch.cat(works)
    else:
        assert places is not None
        _side_by_side(places, specs, works, placed)
        x, works = region, places
    # Muon's polar factor stays in its iteration's dtype: the guard reads it and each part's
    # update widens it as it scales it (one pass fewer over the bucket than a cast back)
    narrow = key.rule == "spectral"
    f = map_fn(key, eta, x, narrow=True) if narrow else map_fn(key, eta, x)
    cdtype = x.dtype if narrow else f.x.dtype  # (the scale in the dtype the update is formed in)
    if seconds is not None:
        # NorMuon's row stage, part by part on its own state (views of the stacks)
        rows: list[torch.Tensor] = []
        at2 = 0
        for spec, w, second, w2 in zip(specs, works, seconds, weights2):
            n = w.shape[0]
            v = second.view(n, spec.work_shape[-2], 1)
            scales = maps.normuon_rows(f.x.narrow(0, at2, n), v, w2, key.eps).row
            assert scales is not None
            rows.append(scales)
            at2 += n
        f = f._replace(row=rows[0] if len(rows) == 1 else torch.cat(rows))
    f, ok = guard(f)
    coef = coefs[0] if len(coefs) == 1 else torch.cat(coefs)
    skips.add_((~ok & (coef != 0)).sum())
    coef = coef * ok
    updates: list[torch.Tensor | None] = []
    at = 0
    for i, (spec, w, weight) in enumerate(zip(specs, works, weights)):
        n = w.shape[0]
        piece = f if len(works) == 1 else _pieces(f, lambda t: t.narrow(0, at, n))
        c = coef.narrow(0, at, n).to(cdtype).view(-1, 1, 1)
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
            if piece.row is None and piece.left is None and piece.right is None and piece.shift is None:
                if torch.compiler.is_compiling():  # (functionalised ``out=`` wants matching strides)
                    out.copy_(piece.x * c)
                else:
                    torch.mul(piece.x, c, out=out)
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
    exp_avg.lerp_(grads, _lead(spec, okf * (1.0 - b1), exp_avg.ndim, sizes))
    # a skipped gradient may hold entries whose square overflows: squares are capped
    sq = torch.mul(grads, grads, out=grads).clamp_(max=torch.finfo(grads.dtype).max)
    exp_avg_sq.lerp_(sq, _lead(spec, okf * (1.0 - b2), exp_avg_sq.ndim, sizes))
    denom = torch.sqrt(exp_avg_sq, out=sq)
    counts = steps.clamp(min=1.0).to(exp_avg.dtype)
    bc1 = 1.0 - torch.pow(b1, counts)
    c = torch.sqrt(1.0 - torch.pow(b2, counts))
    # m / (sqrt(v / bc2) + eps) * (-lr ok / bc1) = m / ((sqrt(v) + c eps) / (-lr ok c / bc1)):
    # a skipped step divides by 0 (m / inf = 0)
    denom.add_(_lead(spec, c * spec.adam_eps, denom.ndim, sizes))
    okl = okf.to(lr.dtype)
    size = (okl * -lr) * c.to(lr.dtype) / bc1.to(lr.dtype)
    denom.div_(_lead(spec, size.to(denom.dtype), denom.ndim, sizes))
    update = None if spec.dtype == exp_avg.dtype else torch.div(exp_avg, denom).to(spec.dtype)
    return update, okl, reported


class Cores:
    """Compiled cores (``torch.compile`` of :func:`bucket_core` and :func:`adamw_core`), one
    per kind of bucket or part: each kind gets its own copy of the function's code, so
    Dynamo's cache (and its recompilation limit) counts per kind, and buckets of one kind
    (equal settings, shapes and dtypes) share one compiled graph.

    ``fallback``: a core that fails to compile (before it runs anything) warns once and runs
    eagerly from then on; otherwise the error is raised. :attr:`failed` keeps the error."""

    def __init__(self, backend: Any, fallback: bool = False):
        self.backend = backend
        self.fallback = fallback
        self.failed: BaseException | None = None
        self.kinds: dict[tuple, Callable] = {}

    def compiled(self, fn: Callable, kind: tuple) -> Callable:
        key = (fn.__name__, kind)
        found = self.kinds.get(key)
        if found is None:
            name = f"{fn.__name__}_{len(self.kinds)}"
            code = fn.__code__.replace(co_name=name)
            fresh = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
            found = self.kinds[key] = torch.compile(fresh, backend=self.backend, fullgraph=True, dynamic=False)
        return found

    def __call__(self, fn: Callable, kind: tuple) -> Callable:
        if self.failed is not None:
            return fn
        compiled = self.compiled(fn, kind)

        def run(*args):
            if self.failed is not None:
                return fn(*args)
            try:
                return compiled(*args)
            except (torch._dynamo.exc.TorchDynamoException, AssertionError) as err:
                # compiling fails before the core runs (Dynamo's own assertions raise
                # AssertionError); a genuine error of the core comes back from the eager call
                if not self.fallback:
                    raise
                self.failed = err
                warnings.warn(
                    f"EquivariantOptimizer: compiling the step failed ({type(err).__name__}: {err}); "
                    "stepping eagerly from now on (pass compile=False to silence, compile=True to raise)",
                    stacklevel=5,
                )
                return fn(*args)

        return run


def run_bucket(
    bucket: Bucket,
    lrs: list[torch.Tensor],
    flags: list,
    skips: torch.Tensor,
    map_fn: Callable[..., maps.Factored] = factored_map,
    cores: Cores | None = None,
) -> None:
    """One step of a bucket: its parts' gradients in, its core (compiled by ``cores`` when
    given), then each part's decay and update; ``flags`` gains each part's names and flags."""
    taken = [part.take() for part in bucket.parts]
    specs = tuple(part.spec for part in bucket.parts)
    core = bucket_core if cores is None else cores(bucket_core, (bucket.key, specs))
    part_lrs = [lrs[part.index] for part in bucket.parts]
    updates, okls, reported = core(
        bucket.key,
        bucket.eta,
        specs,
        [t[0] for t in taken],
        [part.stacked() for part in bucket.parts],
        [t[1] for t in taken],
        [part.stacks["momentum_buffer"] for part in bucket.parts],
        [part.stacks["nonfinite"] for part in bucket.parts],
        part_lrs,
        [part.params[0] if part.spec.single else None for part in bucket.parts],
        skips,
        map_fn,
        [part.stacks[ROW_MOMENT] for part in bucket.parts] if bucket.key.rule == "normuon" else None,
        bucket.scratch,
        [part.place for part in bucket.parts],
    )
    for part, update, okl, flag, lr in zip(bucket.parts, updates, okls, reported, part_lrs):
        flags.append((part.names, flag))
        part.finish(update, okl, lr)


def run_adamw(part: Part, lr: torch.Tensor, flags: list, cores: Cores | None = None) -> None:
    """One AdamW step of a part: its gradients in, its core, its decay and update."""
    source, present, finite = part.take()
    core = adamw_core if cores is None else cores(adamw_core, (part.spec,))
    m, v, steps, counters = part.core_tensors()
    update, okl, reported = core(
        part.spec, source, part.stacked(), present, finite, m, v, steps, counters, lr, part._sizes
    )
    flags.append((part.names, reported))
    part.finish(update, okl, lr)
