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
  (``equiopt::grad_flags``), sanitising, the momentum and Nesterov's direction
  (``equiopt::momentum_stage``; :mod:`.fused`), written into the part's place in the
  map's input (a part whose work is a transpose of its stack copies it there; a centred
  one is centred in place first),
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

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import maps
from ..layouts import Layout, Row
from .apply import GRAD_LIMIT
from .bucket_plan import BucketPlan, PartPlan, plan_buckets
from .cores import Cores
from .fused import ops as fused
from .row_moments import ROW_MOMENT, row_moment_shape, row_moment_views
from .rules import MapKey, factored_map, map_key, rule_named, rule_of, shape_factor
from .sharded import local
from .sharded_buckets import Agree, Placed, bucket_map, shard_like
from .stages import Spec, _finite, adamw_core, bucket_core

__all__ = [
    "Part",
    "Spec",
    "Bucket",
    "Buckets",
    "Cores",
    "make_buckets",
    "plan_buckets",
    "BucketPlan",
    "PartPlan",
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
#: A centred momentum's column means, relative to its RMS, below which it counts as centred
#: (:meth:`Part.keep_centred`): far above float32 rounding's residue, far below any mean a
#: momentum stepped uncentred carries.
CENTRED_TOLERANCE = 1e-4
ADAMW_KEYS = ("exp_avg", "exp_avg_sq")


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
        placed: Placed | None = None,
    ):
        self.group = group
        self.placed = placed  # a sharded part's placement (:mod:`.sharded_buckets`), None for a local one
        self.agree = None if placed is None else Agree(placed.flags)
        self.index = index  # the group's position in param_groups (its learning rate's)
        self.params: list[torch.Tensor] = [group["params"][j] for j in members]
        self.names: list[str] = [group["names"][j] for j in members]
        self.layout = layout
        self.flat = flat
        first = local(self.params[0])  # (a sharded part stacks this rank's blocks)
        self.shape = tuple(first.shape)
        self.dtype, self.device, self.state_dtype = first.dtype, first.device, state_dtype
        rule = rule_of(group)
        self.adamw = rule.adam
        work = layout.work_shapes(self.shape)[0] if not self.adamw else (1, *self.shape)
        self.work_shape = tuple(work)  # one member's work tensor
        self.global_work = self.work_shape if placed is None else placed.global_work
        self.work_is_view = self.adamw or _work_is_view(layout, self.shape)
        self.per_member = 1
        for size in self.work_shape[:-2]:
            self.per_member *= size
        self.structure = _structure(group)  # what the part was built for (checked each step)
        self.sizes = [local(p).numel() for p in self.params]
        self.numel = sum(self.sizes)
        self._sizes = torch.tensor(self.sizes, device=self.device) if flat else None
        keys = ADAMW_KEYS if self.adamw else MOMENTUM_KEYS
        self.stacks: dict[str, torch.Tensor] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        for key in keys:
            self.stacks[key] = self._stack(state, key, state_dtype)
            self.views[key] = self.members_of(self.stacks[key])
        if rule.row_moments:
            entry = row_moment_shape(layout, self.shape)
            self.stacks[ROW_MOMENT] = self._stack(state, ROW_MOMENT, state_dtype, entry=entry)
            self.views[ROW_MOMENT] = list(self.stacks[ROW_MOMENT].unbind(0))
        counters = ("nonfinite", "step") if self.adamw else ("nonfinite",)
        for key in counters:
            self.stacks[key] = self._stack(state, key, torch.float32, scalar=True)
            self.views[key] = list(self.stacks[key].unbind(0))
        # hand out the views: state[p][key] is member k's view of stacks[key] (a sharded
        # member's entries shaped like it are DTensors placed as it is, around the view)
        self.handed: dict[str, list[torch.Tensor]] = {
            key: [self._handed(p, v) for p, v in zip(self.params, views)] for key, views in self.views.items()
        }
        for k, p in enumerate(self.params):
            entry = state[p]
            for key, views in self.handed.items():
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
        self._work_strides: list[int] | None = None  # a member's weight as its work matrices
        # the decay and the update add in one operator where every weight is contiguous
        self._fused_finish = not self.adamw and not flat and all(w.is_contiguous() for w in self.weights())
        self._unit: torch.Tensor | None = None
        if (
            not self.adamw
            and not flat
            and rule.centres_in_place(group)
            and isinstance(layout, Row)
            and len(self.shape) == 2
        ):
            self.keep_centred()

    def _handed(self, p: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        if self.placed is None or view.shape != self.shape:
            return view
        return shard_like(view, p)

    def weights(self) -> list[torch.Tensor]:
        """The members' weights as the step writes them: this rank's blocks of sharded ones."""
        return self.params if self.placed is None else [local(p) for p in self.params]

    def _one(self, like: torch.Tensor) -> torch.Tensor:
        """A ``1`` of ``like``'s dtype and device, made once."""
        if self._unit is None or self._unit.dtype != like.dtype or self._unit.device != like.device:
            self._unit = torch.ones((), dtype=like.dtype, device=like.device)
        return self._unit

    def keep_centred(self) -> None:
        """Centre the momentum of a part whose rule keeps it in the quotient, ``Pi M`` (paper
        section 3.3), where it is made or adopted: the step then lets each gradient in
        centred (:func:`~.stages.bucket_core`), so a momentum adopted from elsewhere (another
        recipe's, or one stepped uncentred) must start there. A column whose mean is within
        :data:`CENTRED_TOLERANCE` of the member's RMS is left as it is (what rounding leaves
        in a centred momentum, so adopting one that is centred changes no bit)."""
        work = self.stacks[MOMENTUM_KEYS[0]]  # (B, m, n): a row layout's work matrices
        if work.dtype != torch.float32:
            return
        with torch.no_grad():
            mean = work.mean(dim=-2, keepdim=True)
            rms = work.square().mean(dim=(-2, -1), keepdim=True).sqrt()
            work.sub_(torch.where(mean.abs() > CENTRED_TOLERANCE * rms, mean, 0.0))

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
                factor=1.0 if self.adamw else shape_factor(g, *self.global_work[-2:]),
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
                add_factor=self._work_strides is not None and len(self.params) > 1,
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
            self._work_strides = self._weight_work_strides() if self.update_in_place and self._fused_finish else None
            self._spec = None

    def _weight_work_strides(self) -> list[int] | None:
        """The strides of a member's weight seen as its ``(P, rows, cols)`` work matrices, where
        that is a view of it (the same for every member: contiguous weights of one shape);
        None where it is not (then :func:`~.fused.ops.factor_add_` does not serve the part)."""
        p = self.weights()[0].detach()
        work = self.layout.to_work_list(p)
        if len(work) != 1 or not 2 <= work[0].dim() <= 3:
            return None
        w = work[0]
        if w.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() or w.storage_offset() != p.storage_offset():
            return None
        strides = list(w.stride()) if w.dim() == 3 else [0, *w.stride()]
        per = w.shape[0] if w.dim() == 3 else 1
        return strides if per == self.per_member and w.shape[-2:] == self.work_shape[-2:] else None

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
            local(t).to(self.device)
            if t is not None
            else torch.zeros(
                () if scalar else entry if entry is not None else local(p).shape, dtype=have.dtype, device=self.device
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
            for key, views in self.handed.items():
                if entry.get(key) is not views[k]:
                    return False
        return True

    # --------------------------------------------------------------- per step
    def take(self, stacked: bool = True) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        """The members' gradients in (eager, before the part's core): ``(source, present,
        finite)``. ``source`` is the one gradient of a single-member part; else, without
        ``stacked``, the list of the members' gradients where the core's fused operators
        read them where they are (contiguous, in the state's dtype, all present, the part
        not flat); else the stack of them in :attr:`scratch` (one ``stack``, or one foreach
        copy where the state is wider or the part flat). ``present`` masks members without
        a gradient this step (None: all have one); ``finite`` are a flat part's finite flags
        (two foreach norms), None where the core takes them. ``.grad`` itself is never
        written."""
        grads: list[torch.Tensor] = []
        missing = False
        for p, name in zip(self.params, self.names):
            g = p.grad
            if g is None:
                missing = True
                shape = local(p).shape
                g = self._zeros.get(shape)
                if g is None:
                    g = self._zeros[shape] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            elif g.layout != torch.strided:  # (the step refuses these first, by rule and name)
                raise ValueError(f"parameter {name!r}: sparse gradients are not supported")
            grads.append(local(g))
        present = self._mask(tuple(p.grad is not None for p in self.params)) if missing else None
        scratch = self.stacked()
        if self.spec.single:
            return grads[0], present, None
        if self.dtype == self.state_dtype and not self.flat:
            if not stacked and present is None and all(g.is_contiguous() for g in grads):
                return grads, None, None
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

    def finish(self, update: Any, okl: torch.Tensor, lr: torch.Tensor) -> None:
        """After the core (eager): the decay ``W <- (1 - lr wd) W`` of every member (exactly 1
        where skipped: ``okl`` the skip flags, bool or 0 and 1 in any dtype) and the update's add: a stack, the core's update in the scratch (None),
        or a narrow factor and its scales (a pair) formed as they are added; a single-member
        part's core did both."""
        if self.spec.single and not self.adamw:
            return
        wd = self.group["weight_decay"]
        decay = torch.addcmul(self._one(lr), lr, okl, value=-wd) if wd else None  # 1 - lr wd ok, one operator
        weights = self.weights()
        if isinstance(update, tuple):
            assert self._work_strides is not None
            factor, scales = update
            fused.factor_add_(weights, factor, scales, decay, self.place, self._work_strides)
            return
        stack = self._update_stack if update is None else update
        if self._fused_finish and stack is not None and stack.is_contiguous():
            fused.decay_add_(weights, stack, decay)
            return
        if decay is not None:
            torch._foreach_mul_(weights, list(torch.unbind(decay, 0)))
        if self.adamw and update is None:
            torch._foreach_addcdiv_(weights, self.views["exp_avg"], self._scratch_members)
        elif update is not None:
            torch._foreach_add_(weights, self.members_of(update))
        else:  # the core left the update in the scratch
            torch._foreach_add_(weights, self._update_members)

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


def _work_is_view(layout: Layout, shape: tuple[int, ...]) -> bool:
    """Whether a contiguous stack's work tensor is the stack itself reshaped: the same memory
    in the same order (a layout that splits heads along rows), not a transposed view."""
    stack = torch.empty((2, *shape), device="meta")
    works = layout.stacked_to_work(stack)
    if len(works) != 1:
        return False
    work = works[0]
    return work.is_contiguous() and work.storage_offset() == 0 and (work is stack or work._base is stack)


class Bucket:
    """Parts whose work matrices share one map: equal map settings (:class:`MapKey`) and
    work-matrix shape (for owner-mapped parts, the shape of the whole matrices their
    exchange maps, :mod:`.sharded_buckets`), on one device in one compute dtype."""

    def __init__(self, key: MapKey, parts: list[Part], division: str = "local", deal: tuple[int, ...] | None = None):
        self.key = key
        self.parts = parts
        self.division = division  # how replicas divide its map (:mod:`.divided`)
        self.eta = parts[0].group["eta"]
        # parts of sharded parameters: their flags agree across ranks, so the bucket runs
        # eagerly; an owner-mapped bucket's map exchanges its blocks (:mod:`.sharded_buckets`)
        self.sharded = any(part.placed is not None for part in parts)
        self.map_fn: Callable[..., maps.Factored] | None = bucket_map(parts, deal)
        self.scratch: torch.Tensor | None = None  # its parts' places end to end (:class:`Buckets`)


class Buckets:
    """Every part and bucket of an optimizer, and the parameters they cover.

    The gradients come in through one buffer per device and state dtype, as large as the
    largest bucket's gradients (every bucket reads its own and is done with them before
    the next begins): sanitised there, never in ``.grad``, and nothing of the gradients'
    size is allocated after the first step."""

    def __init__(
        self,
        matrix: list[Bucket],
        adamw: list[Part],
        declined: set[int] | None = None,
        owner_families: frozenset = frozenset(),
    ):
        self.matrix = matrix
        self.adamw = adamw
        self.declined = declined or set()  # ids of parameters whose bucket ``admit`` declined
        self.covered = {id(p) for b in matrix for part in b.parts for p in part.params}
        self.covered |= {id(p) for part in adamw for p in part.params}
        self.owner_families = owner_families  # the owner buckets' families of ranks (:func:`owner_deals`)
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
    return (rule, group["nonfinite"], group["lazy"], map_key(group) if not rule_named(rule).adam else None)


def make_buckets(
    groups: Iterable[tuple[dict, list[int]]],
    state: dict,
    state_dtype: Callable[[torch.Tensor], torch.dtype],
    admit: Callable[[MapKey, tuple[int, int], int], str | None] | None = None,
    placed: Callable[[dict, int], Placed | None] | None = None,
    whole: Callable[[dict, int], tuple[tuple, float, float, int] | None] | None = None,
) -> Buckets:
    """Parts and buckets of :func:`plan_buckets` (the same arguments), adopting any state the
    members already have; the parameters of a bucket ``admit`` declined keep the
    per-parameter step and are listed in :attr:`Buckets.declined`."""
    planned = plan_buckets(groups, state_dtype, admit, placed, whole)

    def part(p: PartPlan) -> Part:
        return Part(p.group, p.members, p.layout, state, p.state_dtype, p.flat, p.position, p.placed)  # type: ignore[arg-type]

    matrix = [
        Bucket(key, [part(p) for p in parts], division, deal)
        for (key, _, division, parts), deal in zip(planned.matrix, planned.deals)
    ]
    return Buckets(matrix, [part(p) for p in planned.adamw], planned.declined, planned.owner_families)


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
    # an eager core's fused operators read the gradients where they are (compiled code takes stacks)
    stacked = cores is not None or torch.compiler.is_compiling()
    taken = [part.take(stacked=stacked) for part in bucket.parts]
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
        [part.weights()[0] if part.spec.single else None for part in bucket.parts],
        skips,
        map_fn,
        [part.stacks[ROW_MOMENT] for part in bucket.parts] if rule_named(bucket.key.rule).row_moments else None,
        bucket.scratch,
        [part.place for part in bucket.parts],
        [part.agree for part in bucket.parts] if bucket.sharded else None,
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
