"""One ``torch.optim.Optimizer`` for every symmetry-compatible rule (Algorithms 1 and 2).

Per parameter and step, with gradient ``G``:

    M <- beta M + (1 - beta) G                      (EMA momentum; Nesterov: D = beta M + (1 - beta) G, else D = M)
    U <- layout.from_work(map(layout.to_work(D)))   (the group's rule on the work matrices)
    W <- (1 - lr wd) W - lr s U                     (decoupled weight decay; s = lr_scale factor)

Work matrices from all parameters (of all groups) whose map settings and shapes agree
are concatenated and mapped in one batched call, then split back exactly.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from .. import maps
from ..distributed.placements import Sharding, describe_sharding, is_dtensor, mesh_group
from ..layouts import Layout, parse_layout
from . import distribute
from .apply import (
    GRAD_LIMIT,
    adamw_,
    add_factored_,
    add_updates_,
    decays_,
    finite_flags,
    momenta_,
    sanitize_all,
)
from .buckets import Buckets, Cores, make_buckets, run_adamw, run_bucket
from .costs import mesh_cost_model, replica_division, resolve_cost_model
from .distribute import DIVIDED, DIVIDED_RULES, REDUCE, ROWS, BucketKey, WholeTask, WorkItem
from .distribute import LOCAL as LOCAL_MODE
from .fields import ELEMENTWISE_RULES, MATRIX_RULES, PEER_RULES, POLAR_RULES, default
from .peers import build_peer, check_peer_param, step_peer
from .row_moments import (
    ROW_MOMENT,
    row_moment_block,
    row_moment_placements,
    row_moment_shape,
    row_moment_views,
    stage_axes,
)
from .rules import MapKey, map_key, precentred, reducible, shape_factor, validate_group
from .sharded import LOCAL, Plan, ShardSum, global_flags, local, plan, reducers
from .validate import check_hyperparameters, is_default, names_of, saved_param_names


def _check_views(p: torch.Tensor, layout: Layout, name: str) -> None:
    """The step writes updates through the work views of a parameter, so they must alias it."""
    if p.device.type == "meta" or not isinstance(p, torch.Tensor) or type(p.data) is not torch.Tensor:
        return
    base = p.untyped_storage().data_ptr()
    if any(v.untyped_storage().data_ptr() != base for v in layout.to_work_list(p.detach(), name=name)):
        raise ValueError(
            f"parameter {name!r}: layout {layout!r} copies the tensor; it must only reshape, transpose or slice"
        )


def _replica_group(divide_work):
    """The process group of ``divide_work`` (None: no division)."""
    if divide_work is None or divide_work is False:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "divide_work needs an initialised torch.distributed process group (torchrun, "
            "init_process_group); pass divide_work=False for a single process"
        )
    return dist.group.WORLD if divide_work is True else divide_work


_HOST_SIDE = (
    "EquivariantOptimizer keeps its bookkeeping (buckets, peer optimizers, learning rates) on "
    "the host: compile its tensor work with EquivariantOptimizer(..., compile=True), capture it "
    "with equiopt.optim.GraphedStep, or call torch.compile(optimizer.step) without fullgraph=True"
)


def _host_side(fn):
    """Keep ``fn`` out of any graph, with the reason Dynamo reports under ``fullgraph=True``."""
    try:
        return torch._dynamo.disable(fn, reason=_HOST_SIDE)
    except TypeError:  # torch < 2.7: no reason
        return torch._dynamo.disable(fn)


class NonFiniteGradientError(FloatingPointError, ValueError):
    """Raised for a NaN/Inf gradient when a group's ``nonfinite="raise"``."""


class UnsupportedTensorError(ValueError, RuntimeError):
    """A parameter or gradient a rule cannot step: a complex parameter of a matrix rule, a
    sparse gradient. A :class:`RuntimeError`, as torch's own optimizers raise for these,
    and a :class:`ValueError`, as every other check of a parameter here."""


#: Rules that step complex parameters, as torch's AdamW and SGD do: as their real views
#: (``torch.view_as_real``), every operation being element-wise.
COMPLEX_RULES = ("adamw", "sgd", "torch_adamw")

#: torch's optimizer flags that would change what a step computes; this optimizer does not
#: offer them, so a param group asking for one is refused rather than silently ignored.
_UNOFFERED_FLAGS = {
    "maximize": "minimise the negated loss instead",
    "differentiable": "the step runs under torch.no_grad and is not differentiable",
}


def _times(step: torch.Tensor, factor: float) -> torch.Tensor:
    """A step size ``-lr * ok`` times a shape factor (no operator when the factor is 1)."""
    return step if factor == 1.0 else step * factor


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor's real view (a trailing dimension of 2), any other tensor as it is."""
    return torch.view_as_real(t) if t.is_complex() else t


def _check_flags(group: dict, where: str) -> None:
    """Refuse torch's ``maximize=True`` and ``differentiable=True`` in a param group, by name."""
    for flag, instead in _UNOFFERED_FLAGS.items():
        if group.get(flag):
            raise ValueError(
                f"{where}, field {flag!r}: EquivariantOptimizer does not offer {flag}=True ({instead}); "
                f"leave it out or set it to False"
            )


class EquivariantOptimizer(Optimizer):
    r"""Symmetry-compatible optimizer; each param group names its rule, layout and settings.

    Group keys (all optional; every rule's settings, with their defaults and checks, are defined
    once in :data:`equiopt.optim.fields.FIELDS`, printed by ``equiopt fields``, and a recipe
    fills in the same defaults):

    - ``rule``: ``"spectral"`` (Muon: polar factor), ``"right"`` (RightPolarGradM),
      ``"left"`` (LeftPolarGradM), ``"row"`` (RowNormM), ``"hybrid"`` (HybridPolarGradM,
      with ``order``), ``"spectral_row"`` (the polar factor, then its rows normalised),
      ``"normuon"`` (NorMuon), ``"adamw"``, ``"sgd"``.
    - ``layout``: a :mod:`equiopt.layouts` layout or spec string (default ``"row"``), or
      ``layouts``: one per parameter (``None`` entries use ``layout``).
    - ``center`` (horizontal/quotient maps for LM heads and routers), ``order``,
      ``alpha`` (``nu^alpha``; default 1 for hybrid, 0 otherwise), ``eps``, ``method``,
      ``beta2`` (``normuon``'s row second-moment EMA),
      ``steps``, ``eta`` (row-scaling rule), ``polar_dtype`` (spectral iteration
      precision; default bfloat16), ``damping`` of the one-sided and hybrid maps'
      Grams: ``"relative"`` (default: ``eps`` times the Gram's mean eigenvalue, the same
      map at every gradient scale) or ``"absolute"`` (the paper's ``C + eps I``).
    - ``lr``, ``beta`` (EMA momentum), ``nesterov`` (default True for spectral, False
      otherwise), ``weight_decay`` (decoupled), ``betas`` and ``adam_eps`` (adamw).
    - ``lr_scale``: shape factor of the spectral rule, ``"spectral"`` (default for it:
      ``sqrt(max(1, rows/cols))`` of each work matrix, Muon's convention), ``"match_adamw"``
      (``0.2 sqrt(max(rows, cols))``) or ``"none"``.
    - ``nonfinite``: ``"skip"`` (default: a parameter whose gradient has NaN/Inf, or an
      entry beyond ``GRAD_LIMIT`` = 2^50 where float32 squares and Grams could overflow, is
      left untouched, weights and state, and counted in :attr:`nonfinite_steps`) or
      ``"raise"`` (:class:`NonFiniteGradientError` naming the parameters, before anything is
      modified). An update that still came out non-finite is not added to the weights and
      is counted in :attr:`nonfinite_updates`.
    - ``lazy``: update only the rows of each work matrix whose gradient is nonzero in this
      step (the others' momentum still decays); see :meth:`_lazy_rows`. For embeddings.
    - ``param_names``: torch's parameter names (one per parameter), also from
      ``named_parameters()``; they name the parameters in messages and are saved in the
      state dict. ``names`` is the earlier spelling, still accepted. Each live group's
      ``names`` holds the names messages use (``param_names``, else the parameters' places,
      ``"param_groups[i].params[j]"``); it is not saved.

    ``divide_work``: a process group over which the plain (non-DTensor) parameters are
    replicated, as under DDP, or ``True`` for the default group. Each Gram map (right
    Gram one-sided and hybrid) is divided as the cost model finds cheapest
    (:func:`~.costs.replica_division`): by slices of rows for the Gram (``d x d`` sums
    reduced; the inverse square roots of a batch of Grams divided among the ranks too, a
    reduce-scatter and an all-gather in place of the all-reduce; every rank finishes on
    all rows), by rows completely (each rank maps its rows into its weights and
    broadcasts them) or on an owner; the other matrix-product maps (spectral, left Grams)
    run on one rank each, chosen to balance the work, and their updates are broadcast.
    Per-rank work falls with the world size and the weights stay identical on every rank.
    Row-norm and element-wise rules, which cost less than sending their results, run on
    every rank.
    :func:`equiopt.build_optimizer` sets it from a DDP-wrapped model.

    A group with ``center`` stores the momentum of the matrices it maps whole on this rank
    in the quotient, ``Pi M`` (see ``_centre_in_place``): the centred maps see only
    ``Pi M``, so the updates are unchanged and no centred copy of an LM head is formed.

    ``state_dtype`` holds momentum and Adam moments (default: float32 for bfloat16,
    float16 and float32 parameters, float64 for float64 ones); ``eager_state=True`` creates all state at construction so every rank
    and checkpoint sees the same keys from step 0.

    ``cost_model`` picks, for a sharded parameter whose map can run either on the shards
    with all-reduced sums or whole on an owner rank, the cheaper for its mesh
    (:mod:`.costs`): ``None``/``"auto"`` (constants for NCCL on H100 when the mesh is on
    CUDA, gloo on CPU otherwise), ``"nccl-h100"``, ``"gloo-cpu"``, ``"reduce"``/``"owner"``
    (that plan wherever possible) or a :class:`~equiopt.optim.costs.CostModel`.

    ``overlap`` (default True): owner work goes in waves (:data:`~.sharded.WAVES`) whose
    exchanges start asynchronously: for split parameters two waves at a time, the next
    wave's blocks travelling while this wave's maps run and its updates travelling back
    while the next one's run; under ``divide_work`` each wave's broadcasts travel while the
    next wave's maps run. Results are bitwise those of ``overlap=False``, which waits for
    every collective as it is issued.

    The step runs in buckets (:mod:`.buckets`): parameters with equal settings, shapes and
    layouts keep their state stacked and step together in a fixed number of operators;
    sharded and divided parameters, ``lazy`` rows, multi-block layouts and
    ``nonfinite="raise"`` groups step one parameter at a time.

    ``compile`` compiles each bucket's tensor work with ``torch.compile`` (one graph per kind
    of bucket, so momentum, row scaling, centring and the weight update fuse into few
    passes; the bookkeeping and the per-parameter remainder stay eager): ``True``
    (Inductor), a backend name or backend, ``False``, or ``None`` (default: on when every
    parameter is on a CUDA device and the step sends nothing: no DTensor parameters and
    no ``divide_work``; a failed compile then warns and steps eagerly). The step has no host
    reads, so ``torch.compile(optimizer.step)`` works as well, and
    :class:`~equiopt.optim.GraphedStep` replays it from a CUDA graph; learning rates enter
    as device tensors, so a schedule does not recompile either way.

    Args:
        params: parameters or param groups (dicts with ``"params"`` and any setting below).
        lr: learning rate of groups that give none.
        rule: update rule: ``spectral``, ``right``, ``left``, ``row``, ``hybrid``, ``adamw``, ``sgd``.
        layout: work-matrix layout (:mod:`equiopt.layouts` spec or object) of groups that give none.
        center: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        order: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        beta: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        nesterov: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        alpha: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        eps: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        weight_decay: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        method: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        steps: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        eta: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        beta2: group default: NorMuon's row second-moment EMA (``normuon``).
        betas: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        adam_eps: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        lr_scale: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        polar_dtype: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        nonfinite: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        scale: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        damping: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        gram_dtype: group default: the precision of the one-sided and hybrid maps' Gram and final product.
        route: group default: how the one-sided and hybrid maps are computed (``"auto"``, ``"gram"``, ``"direct"``).
        lazy: group default (:data:`equiopt.optim.fields.FIELDS`; ``None``: the rule's).
        state_dtype: dtype of momentum and Adam moments (default: float32, float64 for float64 parameters).
        eager_state: create every state tensor at construction.
        compile: ``torch.compile`` each bucket's work: ``True``, a backend name or backend, ``False`` or ``None`` (automatic).
        divide_work: process group over which plain parameters are replicated (DDP), or ``True``.
        cost_model: how sharded and replicated maps choose their plan (name or ``CostModel``).
        overlap: start owner exchanges and broadcasts asynchronously, in waves.

    Complex parameters: the element-wise rules (``adamw``, ``sgd``) step them as their real
    views (``torch.view_as_real``), as torch's AdamW and SGD do, with complex state; the
    matrix rules refuse them (:class:`UnsupportedTensorError`). torch's ``maximize`` and
    ``differentiable`` are not offered: a param group setting either to True is refused.

    Raises:
        ValueError: an unknown setting value, a parameter the rule cannot step, or placements that
            cannot be supported, each naming the group, setting or parameter.
        UnsupportedTensorError: a complex parameter of a matrix rule (also a ValueError and a
            RuntimeError, as torch's Muon raises for it).
        TypeError: ``params`` a tensor or a set, as torch's optimizers refuse them.

    The settings of :data:`~.validate.CHECKED_FIRST` (``lr``, ``betas``, ``eps``, ...) are
    checked before ``params`` is read, with torch's messages
    (:func:`~.validate.check_hyperparameters`), as torch checks its optimizers.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = default("lr"),
        rule: str = "spectral",
        layout: Any = "row",
        center: bool = default("center"),
        order: str = default("order"),
        beta: float = default("beta"),
        nesterov: bool | None = None,
        alpha: float | None = None,
        eps: float = default("eps"),
        weight_decay: float = default("weight_decay"),
        method: str = default("method"),
        steps: int = default("steps"),
        eta: str | Callable = default("eta"),
        beta2: float = default("beta2", "normuon"),
        betas: tuple[float, float] = default("betas"),
        adam_eps: float = default("adam_eps"),
        lr_scale: str | None = None,
        polar_dtype: torch.dtype | None = None,
        nonfinite: str = default("nonfinite"),
        scale: str | None = None,
        damping: str = default("damping"),
        gram_dtype: str = default("gram_dtype", "right"),
        route: str = default("route", "right"),
        lazy: bool = default("lazy"),
        state_dtype: torch.dtype | None = None,
        eager_state: bool = False,
        compile: bool | str | None = None,
        divide_work: Any = None,
        cost_model: Any = None,
        overlap: bool = True,
    ):
        check_hyperparameters(
            dict(
                rule=rule,
                lr=lr,
                betas=betas,
                eps=eps,
                adam_eps=adam_eps,
                weight_decay=weight_decay,
                beta=beta,
                beta2=beta2,
                alpha=alpha,
                steps=steps,
            )
        )
        if isinstance(params, (set, frozenset)):
            # torch refuses a set in a param group; at the top its order would decide the
            # positions that state dicts and names refer to just the same
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but the ordering of "
                "tensors in sets will change between runs: pass a list (or model.named_parameters())"
            )
        self.state_dtype = state_dtype
        resolve_cost_model(cost_model)  # an unknown name fails here, by name
        self.cost_model = cost_model
        self.overlap = bool(overlap)
        self._replicas = _replica_group(divide_work)
        self.eager_state = eager_state
        self.compile = compile
        self._compiled_step: Cores | None = None
        self._compile_failed = False
        self._lr_cache: dict[int, torch.Tensor] = {}
        self._last_flags: list = []
        self._shardings: dict[int, Sharding] = {}
        self._plans: dict[tuple, Plan] = {}
        self._update_skips: torch.Tensor | None = None
        self._peers: dict[int, tuple[tuple, torch.optim.Optimizer]] = {}
        self._buckets: Buckets | None = None
        self._eligible: dict[int, tuple] = {}
        defaults = dict(
            lr=lr,
            rule=rule,
            layout=layout,
            layouts=None,
            center=center,
            order=order,
            beta=beta,
            nesterov=nesterov,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            method=method,
            steps=steps,
            eta=eta,
            beta2=beta2,
            betas=tuple(betas),
            adam_eps=adam_eps,
            lr_scale=lr_scale,
            polar_dtype=polar_dtype,
            nonfinite=nonfinite,
            scale=scale,
            damping=damping,
            gram_dtype=gram_dtype,
            route=route,
            lazy=lazy,
        )
        super().__init__(params, defaults)

    # ----------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict) -> None:
        """Add a param group, filling its missing settings from the rule's defaults.

        Args:
            param_group: ``{"params": [...], <setting>: value, ...}``.

        Raises:
            ValueError: a bad setting or parameter, naming it; the optimizer is left as it was.
        """
        super().add_param_group(param_group)
        self._buckets, self._eligible = None, {}
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        try:
            self._prepare_group(group, index)
        except Exception:
            del self.param_groups[index]  # a refused group leaves the optimizer as it was
            raise
        if self.eager_state:
            for p in group["params"]:
                self._init_state(p, group)
            self._refresh_buckets()  # the state exists: stack it now

    def _prepare_group(self, group: dict, index: int) -> None:
        where = f"param_groups[{index}]"
        validate_group(group, where)
        _check_flags(group, where)
        params = group["params"]
        group["names"] = names = names_of(group, where)  # param_names, else places; not saved
        per_param = group.get("layouts")
        if per_param is not None and len(per_param) != len(params):
            raise ValueError(f"{where}: 'layouts' has {len(per_param)} entries for {len(params)} parameters")
        layouts = []
        rule = group["rule"]
        for j, p in enumerate(params):
            if p.is_complex():
                if rule not in COMPLEX_RULES:
                    raise UnsupportedTensorError(
                        f"rule {rule!r} does not support complex parameters: parameter {names[j]!r} has dtype "
                        f"{p.dtype} (its maps act on real matrices); give it rule 'adamw' or 'sgd', which step "
                        "complex parameters as their real views, or optimise its real and imaginary parts"
                    )
                if group["lazy"]:
                    raise ValueError(f"parameter {names[j]!r} has dtype {p.dtype}: lazy=True needs real parameters")
            elif not p.is_floating_point():
                raise ValueError(
                    f"parameter {names[j]!r} has dtype {p.dtype}: EquivariantOptimizer steps floating-point "
                    "tensors (float64, float32, bfloat16, float16; complex ones with rule 'adamw' or 'sgd'), "
                    "not integer or boolean ones"
                )
            # unsupported placements (Partial, non-contiguous splits) fail here, by name
            sharding = self._shardings[id(p)] = describe_sharding(p, names[j])
            spec = group["layout"] if per_param is None or per_param[j] is None else per_param[j]
            try:
                layout = parse_layout(spec)
            except ValueError as err:
                raise ValueError(f"parameter {names[j]!r}: {err}") from None
            if group["rule"] in PEER_RULES:
                check_peer_param(group["rule"], p, names[j], sharding.kind == "sharded" and sharding.is_sharded)
            if group["rule"] in MATRIX_RULES:
                if p.ndim < 2 and layout.ndim != p.ndim:
                    raise ValueError(
                        f"parameter {names[j]!r} has shape {tuple(p.shape)}: rule {group['rule']!r} needs a matrix "
                        f"(it only supports parameters of 2 or more dimensions, or a flat one with layout "
                        "'unflatten:ROWS'); give vectors and scalars rule 'adamw' or 'sgd'"
                    )
                layout.check(tuple(p.shape), names[j])
                _check_views(p, layout, names[j])
                how = self.plan_of(group, layout, sharding)
                if rule == "normuon" and sharding.kind == "sharded":
                    if how.how == "owner":  # the groups of its row stage's sums
                        for axes in stage_axes(layout, sharding):
                            if axes:
                                mesh_group(sharding.mesh, axes)
                self._make_groups(how, sharding)
            layouts.append(layout)
        group["layouts"] = layouts

    # ------------------------------------------------------------------ state
    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if state or group["rule"] in PEER_RULES:  # a peer's torch optimizer makes its own
            if state and group["rule"] == "normuon" and ROW_MOMENT not in state:
                self._row_moment(p, group, state)  # state of another rule: its rows start at zero
            return state
        dtype = self._state_dtype(p)
        zeros = lambda: torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if group["rule"] == "adamw":
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = zeros()
            state["exp_avg_sq"] = zeros()
        else:
            state["momentum_buffer"] = zeros()
            if group["rule"] == "normuon":
                self._row_moment(p, group, state)
        state["nonfinite"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return state

    def _row_moment(self, p: torch.Tensor, group: dict, state: dict) -> None:
        """NorMuon's row second moments of ``p``, zeros: one per row of each work matrix."""
        j = next(k for k, q in enumerate(group["params"]) if q is p)
        layout, dtype = group["layouts"][j], self._state_dtype(p)
        shape = row_moment_shape(layout, tuple(p.shape))
        if not is_dtensor(p):
            state[ROW_MOMENT] = torch.zeros(shape, dtype=dtype, device=p.device)
            return
        from torch.distributed.tensor import DTensor

        placements = row_moment_placements(p.placements, layout, tuple(p.shape))  # type: ignore[attr-defined]
        mine = row_moment_block(layout, tuple(p.shape), self._sharding(p).block)
        stride = torch.empty(shape, device="meta").stride()
        zeros = torch.zeros(mine, dtype=dtype, device=local(p).device)
        mesh = p.device_mesh  # type: ignore[attr-defined]
        state[ROW_MOMENT] = DTensor.from_local(zeros, mesh, placements, shape=torch.Size(shape), stride=stride)

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of ``p``'s momentum and moments: ``state_dtype``, or float32 (float64 for
        float64 parameters); for a complex parameter the complex dtype of that precision."""
        wide = p.dtype in (torch.float64, torch.complex128)
        dtype = self.state_dtype or (torch.float64 if wide else torch.float32)
        if p.is_complex():
            return torch.complex128 if dtype == torch.float64 else torch.complex64
        return dtype

    @property
    def divides_work(self) -> bool:
        """Whether matrix-product maps are divided among replicas (``divide_work``)."""
        return self._replicas is not None

    @property
    def nonfinite_steps(self) -> int:
        """Parameter-steps skipped for a NaN/Inf gradient, summed over parameters.

        The counts live on the device, one per parameter (``state[p]["nonfinite"]``, so
        every checkpoint format keeps them); reading this property reads them back.
        """
        counts = [st["nonfinite"] for st in self.state.values() if isinstance(st, dict) and "nonfinite" in st]
        return int(torch.stack([c.detach().cpu() for c in counts]).sum()) if counts else 0

    @property
    def nonfinite_updates(self) -> int:
        """Work-matrix updates that came out non-finite from a usable gradient and were not
        added to the weights (a last guard: no gradient within ``GRAD_LIMIT`` has produced
        one in the property tests). Reading it reads the device counter back."""
        return int(self._update_skips.detach().cpu()) if self._update_skips is not None else 0

    def _add(self, triples: list[tuple[torch.Tensor, maps.Factored, torch.Tensor]]) -> None:
        """Add work matrices' updates to their weights (guarded) and count the refused ones:
        ``(view, update, coef)`` triples. Whole updates of the views' dtype go in together
        (:func:`~.apply.add_updates_`), factored ones one by one (:func:`~.apply.add_factored_`)."""
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
        if flags:
            skips = self._skip_counter()
            ok = flags[0] if len(flags) == 1 else torch.cat([f.to(skips.device) for f in flags])
            skips.add_(ok.logical_not().sum().to(skips.device, torch.float32))

    @property
    def last_nonfinite(self) -> list[str]:
        """Names of the parameters skipped by the last step (reads the flags back)."""
        names: list[str] = []
        for group_names, flags in self._last_flags:
            names.extend(n for n, ok in zip(group_names, flags.cpu().tolist()) if not ok)
        return names

    def state_dict(self) -> dict:
        """torch's state dict, with layouts as spec strings so ``torch.load(weights_only=True)`` reads it.

        Names are torch's ``param_names`` (a group named by ``names`` saves them so); the
        live groups' ``names`` are not saved, so two equal optimizers, one built from
        ``named_parameters()``, give state dicts that differ in ``param_names`` alone.

        Returns:
            ``{"state", "param_groups"}`` as torch's, plus ``"nonfinite_updates"`` once counted.
        """
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group["layouts"] = [layout.spec for layout in group["layouts"]]
            names = group.pop("names", None)
            if "param_names" not in group and names is not None and not is_default(names):
                group["param_names"] = list(names)
        if self._update_skips is not None:
            sd["nonfinite_updates"] = self._update_skips.detach().clone()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`, keeping the saved state dtypes (float32 moments of
        bfloat16 parameters) so a round trip is exact.

        All or nothing: every group's settings and layouts and every state tensor's shape are
        checked before anything changes, so a refused load leaves the optimizer as it was.
        Older formats load: a state dict from before a setting existed keeps this optimizer's
        value, and an AdamW ``step`` saved as a number becomes a tensor. The hooks of
        :meth:`register_load_state_dict_pre_hook` run first, once, as torch runs them (so a
        hook may convert a state dict the checks would refuse), then the checks. Parameter
        names given to this optimizer (``param_names``, ``named_parameters()`` or ``names``)
        stay its own; one built without names takes the saved ``param_names`` (or the
        ``names`` an earlier version saved).

        Args:
            state_dict: from :meth:`state_dict` (also of an earlier version of this optimizer).

        Raises:
            ValueError: a group, layout or state tensor that does not fit, naming it.
        """
        sd = dict(state_dict)
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            changed = hook(self, sd)
            if changed is not None:
                sd = dict(changed)
        sd.pop("nonfinite_steps", None)  # older format: a host counter, now per parameter in state
        skips = sd.pop("nonfinite_updates", None)
        groups = [dict(g) for g in sd["param_groups"]]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        ids, params = [], []
        owner_rule: dict[int, tuple] = {}
        for index, (group, own) in enumerate(zip(groups, self.param_groups)):
            where = f"param_groups[{index}]"
            if len(group["params"]) != len(own["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
                )
            for key, value in own.items():
                if key not in ("params", "names", "param_names"):
                    group.setdefault(key, value)  # a state_dict from before a setting existed: keep this one's
            validate_group(group, where)
            _check_flags(group, where)
            saved_names = saved_param_names(group)  # (and an earlier version's names)
            if "param_names" in own:
                group["param_names"] = list(own["param_names"])  # this optimizer's names describe its parameters
                group["names"] = own["names"]
            elif not is_default(own["names"]) or not saved_names or len(saved_names) != len(own["params"]):
                group.pop("param_names", None)  # named by ``names``, or the saved names do not fit
                group["names"] = own["names"]
            else:
                group["param_names"], group["names"] = saved_names, list(saved_names)
            layouts = []
            for j, (spec, p) in enumerate(zip(group["layouts"], own["params"])):
                name = group["names"][j]
                if p.is_complex() and group["rule"] not in COMPLEX_RULES:
                    raise UnsupportedTensorError(
                        f"{where}: rule {group['rule']!r} does not support complex parameters: parameter "
                        f"{name!r} has dtype {p.dtype}"
                    )
                try:
                    layout = parse_layout(spec)
                    if group["rule"] in MATRIX_RULES:
                        layout.check(tuple(p.shape), name)
                except ValueError as err:
                    raise ValueError(f"{where}: {err}") from None
                layouts.append(layout)
            group["layouts"] = layouts
            ids.extend(group["params"])
            params.extend(own["params"])
            owner_rule.update({id(p): (group["rule"], lay) for p, lay in zip(own["params"], layouts)})
        saved = dict(sd["state"])
        for i, p in zip(ids, params):
            entry = saved.get(i)
            if not entry:
                continue
            entry = saved[i] = dict(entry)
            for key, value in entry.items():
                if key in ("momentum_buffer", "exp_avg", "exp_avg_sq") and torch.is_tensor(value):
                    if tuple(value.shape) != tuple(p.shape):
                        raise ValueError(
                            f"loaded state dict: {key!r} of parameter {i} has shape {tuple(value.shape)}, "
                            f"the parameter {tuple(p.shape)}"
                        )
                if key == ROW_MOMENT and torch.is_tensor(value) and owner_rule[id(p)][0] == "normuon":
                    want = row_moment_shape(owner_rule[id(p)][1], tuple(p.shape))
                    if tuple(value.shape) != want and not is_dtensor(value) and value.numel() == math.prod(want):
                        entry[key] = value.reshape(want)  # the flat format of an earlier version
                    elif tuple(value.shape) != want:
                        raise ValueError(
                            f"loaded state dict: {key!r} of parameter {i} has shape {tuple(value.shape)}, "
                            f"its work matrices' rows {want}"
                        )
            if "step" in entry and not torch.is_tensor(entry["step"]):
                entry["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32)  # older format
        # everything checked: from here on nothing refuses
        sd["param_groups"], sd["state"] = groups, saved
        if skips is not None:
            device = next((p.device for g in self.param_groups for p in g["params"]), skips.device)
            self._update_skips = skips.detach().to(device=device, dtype=torch.float32, copy=True)
        self._buckets, self._eligible = None, {}
        hooks = self._optimizer_load_state_dict_pre_hooks
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()  # they ran above
        try:
            super().load_state_dict(sd)
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks
        # torch casts floating state to each parameter's dtype; keep the saved dtypes
        # (float32 moments of bfloat16 parameters) so a round trip is exact, and keep
        # the counters on the parameter's device so the step never mixes devices.
        for i, p in zip(ids, params):
            for key, value in saved.get(i, {}).items():
                if torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=value.dtype, copy=True)
            state = self.state.get(p)  # (no empty entry for a parameter without state)
            if state and "nonfinite" not in state:
                state["nonfinite"] = torch.zeros((), dtype=torch.float32, device=p.device)
        self._refresh_buckets()  # stack the loaded state now

    # Caches of the step (keyed by object ids, or compiled code): rebuilt after a copy.
    _CACHES = (
        "_compiled_step",
        "_lr_cache",
        "_last_flags",
        "_shardings",
        "_plans",
        "_peers",
        "_buckets",
        "_eligible",
    )

    def __getstate__(self) -> dict:
        """torch's state (defaults, state, param groups) and this optimizer's own settings,
        so that ``copy.deepcopy`` and pickling give an optimizer that steps; hooks and
        caches are not copied."""
        state = super().__getstate__()
        for key, value in vars(self).items():
            if key not in state and key not in self._CACHES and not key.startswith("_optimizer_"):
                state[key] = value
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._compiled_step = None
        self._lr_cache, self._last_flags, self._shardings, self._plans, self._peers = {}, [], {}, {}, {}
        self._buckets, self._eligible = None, {}

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step. No tensor is read back to the host (``nonfinite="raise"``
        excepted), so the step neither stalls an accelerator nor breaks a compiled graph.

        Learning rates enter the update as device tensors (refreshed from the param
        groups each step), so a schedule changes no compiled graph: under
        ``torch.compile(optimizer.step)`` and with ``compile=True`` the step compiles a
        bounded number of times, however many parameters and steps there are.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            UnsupportedTensorError: a sparse gradient (a RuntimeError, as torch's optimizers
                raise), naming the rule and parameter; checked before anything is stepped.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_gradients()
        self._step_peers()
        self._refresh_buckets()
        lrs = self._lr_tensors()
        backend = self._resolve_compile()
        cores = None
        if backend:
            found = self._compiled_step
            if not isinstance(found, Cores) or found.backend != backend:
                # the automatic choice (CUDA) must not cost a run: a failed compile warns and steps eagerly
                found = self._compiled_step = Cores(backend, fallback=self.compile is None)
            cores = found
        self._skip_counter()  # made outside any graph: a compiled core sets no attribute
        self._last_flags = self._step_impl(lrs, cores)
        if cores is not None and cores.failed is not None:
            self._compile_failed = True
        return loss

    def _skip_counter(self) -> torch.Tensor:
        """The device counter of skipped work-matrix updates (made on first use)."""
        if self._update_skips is None:
            device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
            self._update_skips = torch.zeros((), dtype=torch.float32, device=device)
        return self._update_skips

    def _stackable(self, group: dict) -> list[int]:
        """Positions of ``group``'s parameters whose state a bucket may stack (see
        :mod:`.buckets`): plain tensors of the matrix rules (one work tensor each, not
        ``lazy``; not the matrix-product maps that ``divide_work`` divides among replicas)
        and of ``adamw``, when the group skips non-finite gradients; each once it has state
        or a gradient."""
        settings = (group["rule"], group["nonfinite"], group["lazy"], len(group["params"]))
        cached = self._eligible.get(id(group))
        if cached is None or cached[0] != settings:
            cached = self._eligible[id(group)] = (settings, self._eligible_members(group))
        params = group["params"]
        return [j for j in cached[1] if params[j].grad is not None or self.state.get(params[j])]

    def _eligible_members(self, group: dict) -> list[int]:
        rule = group["rule"]
        if (
            (self._replicas is not None and rule in DIVIDED_RULES)  # divided among replicas: distribute.run
            or group["nonfinite"] != "skip"
            or group["lazy"]
            or (rule not in MATRIX_RULES and rule != "adamw")
        ):
            return []
        out = []
        for j, p in enumerate(group["params"]):
            if (
                p.numel() == 0
                or p.is_complex()  # stepped as its real view, on the per-parameter path
                or self._sharding(p).kind != "local"
                or type(p.data) is not torch.Tensor
            ):
                continue
            if rule != "adamw" and group["layouts"][j].num_blocks != 1:
                continue
            out.append(j)
        return out

    @_host_side
    def _refresh_buckets(self) -> None:
        """Make the buckets again when a parameter that a bucket could hold has none, or a
        member's state entry is no longer the view its bucket handed out (a loaded state
        dict, a state entry replaced by hand)."""
        found = self._buckets
        if found is not None and found.intact(self.state):
            fresh = any(
                p.grad is not None and id(p) not in found.covered
                for g in self.param_groups
                for p in (g["params"][j] for j in self._stackable(g))
            )
            if not fresh:
                return
        self._buckets = make_buckets(
            [(g, self._stackable(g)) for g in self.param_groups], self.state, self._state_dtype
        )

    @_host_side
    def _check_gradients(self) -> None:
        """Refuse sparse gradients, by rule and parameter name, before anything is stepped
        (torch's optimizers raise a RuntimeError for those they do not support)."""
        for group in self.param_groups:
            for j, p in enumerate(group["params"]):
                grad = p.grad
                if grad is not None and grad.layout != torch.strided:
                    raise UnsupportedTensorError(
                        f"rule {group['rule']!r} does not support sparse gradients: parameter "
                        f"{group['names'][j]!r} has a gradient of layout {grad.layout}; make it dense "
                        "(p.grad = p.grad.to_dense(), or nn.Embedding(sparse=False))"
                    )

    @_host_side
    def _step_peers(self) -> None:
        """Step the groups of the peer rules with torch's own optimizers (eager, see :mod:`.peers`)."""
        for index, group in enumerate(self.param_groups):
            if group["rule"] not in PEER_RULES:
                continue
            key = (group["rule"], tuple(id(p) for p in group["params"]))
            cached = self._peers.get(index)
            if cached is None or cached[0] != key:
                cached = self._peers[index] = (key, build_peer(group))
            inner = cached[1]
            step_peer(inner, group, self.state)

    def _resolve_compile(self) -> Any:
        """The ``torch.compile`` backend of the step, or None for eager."""
        setting = self.compile
        if setting is None:
            # Automatic: on CUDA, unless a group must read its flags back to raise.
            setting = (
                not self._compile_failed
                and all(g["nonfinite"] != "raise" for g in self.param_groups)
                and self._on_cuda()
            )
        if isinstance(setting, str) or callable(setting):
            return setting  # a backend name, or a backend itself
        return "inductor" if setting else None

    def _on_cuda(self) -> bool:
        """Every parameter is a plain CUDA tensor and the step issues no collective."""
        params = [p for g in self.param_groups for p in g["params"]]
        return self._replicas is None and all(
            p.device.type == "cuda" and self._sharding(p).kind == "local" for p in params
        )

    @_host_side
    def _lr_tensors(self) -> list[torch.Tensor]:
        """Each group's learning rate as a 0-d tensor on its parameters' device (float64
        where the device has it, so float64 runs keep their precision)."""
        out = []
        for index, group in enumerate(self.param_groups):
            lr = group["lr"]
            if torch.is_tensor(lr):
                out.append(lr if lr.dim() == 0 else lr.view(()))  # torch's tensor lr, read on its device
                continue
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            dtype = torch.float32 if device.type == "mps" else torch.float64
            cached = self._lr_cache.get(index)
            if cached is None or cached.device != device:
                cached = self._lr_cache[index] = torch.empty((), dtype=dtype, device=device)
            cached.fill_(lr)
            out.append(cached)
        return out

    @torch.no_grad()
    def _step_impl(self, lrs: list[torch.Tensor], cores: Cores | None = None) -> list[tuple[list[str], torch.Tensor]]:
        """The step; returns each group's (or part's) parameter names and finite flags. With
        ``cores`` each bucket's tensor work runs compiled (:class:`~.buckets.Cores`); the
        parameters outside buckets step eagerly."""
        last_flags: list[tuple[list[str], torch.Tensor]] = []
        buckets: dict[BucketKey, list[WorkItem]] = defaultdict(list)
        whole: list[WholeTask] = []
        stacked = self._buckets
        covered: set[int] = set()
        if stacked is not None:
            covered = stacked.covered
            for bucket in stacked.matrix:
                run_bucket(bucket, lrs, last_flags, self._skip_counter(), distribute.factored_map, cores)
            for part in stacked.adamw:
                run_adamw(part, lrs[part.index], last_flags, cores)
        for group, lr in zip(self.param_groups, lrs):
            live = [j for j, p in enumerate(group["params"]) if p.grad is not None and id(p) not in covered]
            if not live or group["rule"] in PEER_RULES:
                continue
            params = [group["params"][j] for j in live]
            names = [group["names"][j] for j in live]
            flags = finite_flags([_real(local(p.grad)) for p in params])
            flags = global_flags(flags, [self._sharding(p) for p in params])
            if group["nonfinite"] == "raise":
                self._raise_nonfinite(flags, names)
            last_flags.append((names, flags))
            states = [self._init_state(p, group) for p in params]
            okfs = self._ok_floats(flags, params)
            torch._foreach_add_(
                [st["nonfinite"] for st in states], torch._foreach_add(torch._foreach_neg(okfs[1]), 1.0)
            )
            if group["rule"] == "adamw":
                self._adamw(group, lr, params, states, okfs[0])
                continue
            self._matrix_steps(group, lr, live, params, states, okfs[0], buckets, whole)
        distribute.run(
            buckets, whole, self._add, replicas=self._replicas, overlap=self.overlap, cost_model=self.cost_model
        )
        return last_flags

    @staticmethod
    def _raise_nonfinite(flags: torch.Tensor, names: list[str]) -> None:
        """``nonfinite="raise"``: the one policy that reads back (one host sync per group)."""
        bad = [name for name, ok in zip(names, flags.cpu().tolist()) if not ok]
        if bad:
            raise NonFiniteGradientError(
                f"non-finite gradient (NaN, Inf, or entries beyond +-{GRAD_LIMIT:.3g}) in "
                f"{', '.join(repr(b) for b in bad)}"
            )

    def _ok_floats(self, flags: torch.Tensor, params: list[torch.Tensor]):
        """Per parameter, its finite flag as a 0-d tensor in its state dtype (for step
        sizes) and in float32 (for the counters)."""
        ok32 = flags.to(torch.float32)
        wide = [self._state_dtype(p) in (torch.float64, torch.complex128) for p in params]
        narrow = list(ok32.unbind(0))
        if not any(wide):
            return narrow, narrow
        ok64 = flags.to(torch.float64).unbind(0)
        return [ok64[k] if w else narrow[k] for k, w in enumerate(wide)], narrow

    def _sharding(self, p: torch.Tensor) -> Sharding:
        found = self._shardings.get(id(p))
        if found is None:
            found = self._shardings[id(p)] = describe_sharding(p)
        return found

    def plan_of(self, group: dict, layout: Layout, sharding: Sharding, key: MapKey | None = None) -> Plan:
        """The :class:`~.sharded.Plan` of a parameter of ``group`` (the step's own decision;
        ``key``: the group's :func:`map_key`, when the caller has it). Made once per
        parameter, map settings and layout: the step asks for it every time."""
        if sharding.kind != "sharded":
            return LOCAL
        key = map_key(group) if key is None else key
        cache_key = (id(sharding), key, layout, self.cost_model)
        found = self._plans.get(cache_key)
        if found is None:
            found = self._plans[cache_key] = plan(
                key, layout, sharding, mesh_cost_model(self.cost_model, sharding.mesh)
            )
        return found

    @staticmethod
    def _make_groups(how: Plan, sharding: Sharding) -> None:
        """Create, at construction and in the same order on every rank, the process groups
        a parameter's step will use (products of mesh axes are made by a collective call)."""
        if sharding.kind != "sharded" or not sharding.is_sharded:
            return
        mesh_group(sharding.mesh, sharding.split_axes)
        within = tuple(a for a in how.axes if a not in how.replicas)  # owner work that replicas repeat
        for axes in (how.row_sum_axes, how.cols) if how.how == "reduce" else (how.axes, within):
            if axes:
                mesh_group(sharding.mesh, axes)

    def _matrix_steps(self, group, lr, live, params, states, okfs, buckets, whole) -> None:
        """Momentum and decay of the parameters of ``group`` that no bucket holds (each
        stage one foreach operator over all of them; on a DTensor, of this rank's block:
        ``p``, its gradient and state are DTensors, their local tensors are stepped), then
        each one's map queued (:meth:`_queue_map`)."""
        bufs = [_real(local(st["momentum_buffer"])) for st in states]
        grads = sanitize_all([_real(local(p.grad)) for p in params], [b.dtype for b in bufs])
        directions = momenta_(bufs, grads, okfs, group["beta"], group["nesterov"])
        weights = [_real(local(p)) for p in params]
        decays_(weights, lr, group["weight_decay"], okfs)
        steps = torch._foreach_mul(okfs, -lr)  # -lr, or 0 where skipped
        if group["rule"] == "sgd":
            if group["lazy"]:
                directions = [
                    self._lazy_rows(
                        d,
                        g,
                        group["layouts"][j],
                        self.plan_of(group, group["layouts"][j], self._sharding(p)),
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
            shape_factor(group, *group["layouts"][j].work_shapes(self._sharding(p).shape)[0][-2:])
            for j, p in zip(live, params)
        ]
        scaled = torch._foreach_mul(steps, factors) if any(f != 1.0 for f in factors) else steps
        for j, p, st, okf, step, d, g, w, first in zip(
            live, params, states, okfs, steps, directions, grads, weights, zip(factors, scaled)
        ):
            self._queue_map(group, key, step, j, p, st, okf, d, g, w, buckets, whole, first)

    def _queue_map(self, group, key, step, j, p, state, okf, direction, grad, w, buckets, whole, first) -> None:
        """Queue the map of one parameter's momentum ``direction`` (``w``: this rank's block
        of its weights) for :func:`.distribute.run`: in ``buckets`` (batched by settings,
        shape and mode; under ``divide_work`` the matrix-product maps of plain parameters are
        divided among the replicas) or in ``whole`` (split work that needs whole matrices).
        ``first``: a shape factor and ``step`` times it, made for the whole group at once."""
        sharding = self._sharding(p)

        def times(factor: float) -> torch.Tensor:
            return first[1] if factor == first[0] else _times(step, factor)

        layout = group["layouts"][j]
        how = self.plan_of(group, layout, sharding, key)
        if group["lazy"]:
            direction = self._lazy_rows(direction, grad, layout, how, group["names"][j])
        p = w
        if how.how == "owner":
            if key.rule == "normuon":  # the owner maps the polar factor, each rank its rows' stage
                factor = shape_factor(group, *layout.work_shapes(sharding.shape)[0][-2:])
                second = (local(state[ROW_MOMENT]), okf * (1.0 - group["beta2"]), sharding.block)
                whole.append(WholeTask(group, key, layout, sharding, how, p, direction, times(factor), second))
            else:
                whole.append(WholeTask(group, key, layout, sharding, how, p, direction, step))
            return
        if how.how == "local" and group["center"] and key.rule not in POLAR_RULES:
            key = self._centre_in_place(direction, layout, okf, key)
        global_shapes = layout.work_shapes(sharding.shape)
        sums = reducers(how, sharding, global_shapes[0]) if how.how == "reduce" else None
        divide = self._replicas is not None and sharding.kind == "local" and key.rule in DIVIDED_RULES
        division = None
        if divide and reducible(key, *global_shapes[0][-2:]) and len(global_shapes) == 1:
            import torch.distributed as dist

            part = (dist.get_rank(self._replicas), dist.get_world_size(self._replicas))
            division = replica_division(
                resolve_cost_model(self.cost_model, p.device.type), key, global_shapes[0], part[1], self.overlap
            )
        if division in ("gram", "rows"):
            # a Gram map of a replicated matrix: each replica sums a slice of the rows, the
            # d x d sums are all-reduced, every replica finishes the map on all rows
            sums, divide = (ShardSum(self._replicas, global_shapes[0][-2], part, divide=True), None), False
            if division == "rows":
                # cheaper still: each replica maps its rows completely into its weights and broadcasts them
                buckets[BucketKey(key, tuple(global_shapes[0][-2:]), ROWS, (id(self._replicas),))].append(
                    WorkItem(
                        layout.to_work_list(direction)[0],
                        self._work_views(p, layout)[0],
                        times(shape_factor(group, *global_shapes[0][-2:])),
                        group,
                        sums,
                    )
                )
                return
        seconds: list = [None] * len(global_shapes)
        if key.rule == "normuon":
            weight = okf * (1.0 - group["beta2"])
            seconds = [(v, weight) for v in row_moment_views(layout, tuple(p.shape), local(state[ROW_MOMENT]))]
        for w, pw, gshape, second in zip(
            layout.to_work_list(direction), self._work_views(p, layout), global_shapes, seconds
        ):
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

    @staticmethod
    def _lazy_rows(direction: torch.Tensor, grad: torch.Tensor, layout: Layout, how: Plan, name: str) -> torch.Tensor:
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

    @staticmethod
    def _centre_in_place(direction: torch.Tensor, layout: Layout, okf: torch.Tensor, key: MapKey) -> MapKey:
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

    @staticmethod
    def _work_views(p: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
        """The parameter's work matrices as views: the update is added to them in place
        (every layout only reshapes, transposes and slices; checked when the group is built).
        The step runs under ``no_grad``, where a parameter's views are written in place as is."""
        return layout.to_work_list(p)

    def _adamw(self, group: dict, lr, params: list, states: list, okfs: list) -> None:
        """AdamW with bias correction and decoupled decay, with torch's foreach kernels (a
        complex parameter, its gradient and moments as their real views)."""
        buckets: dict[tuple, list] = defaultdict(list)
        for k, (p, st) in enumerate(zip(params, states)):
            w, m, v = _real(local(p)), _real(local(st["exp_avg"])), _real(local(st["exp_avg_sq"]))
            buckets[(w.dtype, w.device, m.dtype)].append((w, (m, v, st["step"]), okfs[k], _real(local(p.grad))))
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


__all__ = [
    "EquivariantOptimizer",
    "NonFiniteGradientError",
    "UnsupportedTensorError",
    "COMPLEX_RULES",
    "ELEMENTWISE_RULES",
    "MATRIX_RULES",
]
