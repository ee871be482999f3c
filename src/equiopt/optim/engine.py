"""One ``torch.optim.Optimizer`` for every symmetry-compatible rule (Algorithms 1 and 2):
the class, its settings and its step's order. The jobs live beside it:

- :mod:`.param_groups`: a group validated and made ready (layouts, placements, process groups);
- :mod:`.state_entries`: a parameter's state, made at its first step;
- :mod:`.state_io`: loading a state dict, all or nothing;
- :mod:`.stacking` and :mod:`.buckets`: the parameters stepped together on stacked state;
- :mod:`.per_parameter` and :mod:`.distribute`: every other parameter, each on its placement's plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from ..distributed.placements import Sharding, describe_sharding
from ..layouts import Layout
from . import distribute, per_parameter
from .buckets import Buckets, Cores, make_buckets, run_adamw, run_bucket
from .costs import mesh_cost_model, resolve_cost_model
from .divided import Divisions, replica_group
from .errors import NonFiniteGradientError, UnsupportedTensorError
from .fields import ELEMENTWISE_RULES, MATRIX_RULES, default
from .param_groups import COMPLEX_RULES, check_gradients, prepare_group
from .peers import step_peers
from .rules import MapKey, map_key
from .sharded import LOCAL, Plan, plan
from .sharded_buckets import Placed, placed_member, whole_task
from .stacking import stackable
from .state_entries import init_state, state_dtype
from .state_io import load_state_dict
from .validate import check_hyperparameters, is_default

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
    Row-norm and element-wise rules (cheaper than sending their results) run on every rank.
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
    layouts, whole or evenly sharded, keep their state stacked and step together in a fixed
    number of operators; the others (docs/step.md) step one parameter at a time.

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
        self._replicas = replica_group(divide_work)
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
        self._divided: Divisions | None = None
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
        self._buckets, self._eligible, self._divided = None, {}, None
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        try:
            prepare_group(self, group, index)
        except Exception:
            del self.param_groups[index]  # a refused group leaves the optimizer as it was
            raise
        if self.eager_state:
            for p in group["params"]:
                self._init_state(p, group)
            self._refresh_buckets()  # the state exists: stack it now

    # ------------------------------------------------------------------ state
    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        return init_state(self, p, group)

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return state_dtype(self, p)

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
        load_state_dict(self, state_dict, super().load_state_dict)

    # Caches of the step (keyed by object ids, or compiled code): rebuilt after a copy.
    _CACHES = tuple("_compiled_step _lr_cache _last_flags _shardings _plans _peers _buckets _eligible _divided".split())

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
        self._buckets, self._eligible, self._divided = None, {}, None

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
        return stackable(self, group)

    @_host_side
    def _refresh_buckets(self) -> None:
        """Make the buckets again when a parameter that a bucket could hold has none, or a
        member's state entry is no longer the view its bucket handed out (a loaded state
        dict, a state entry replaced by hand)."""
        found = self._buckets
        if found is not None and found.intact(self.state):
            fresh = any(
                p.grad is not None and id(p) not in found.covered and id(p) not in found.declined
                for g in self.param_groups
                for p in (g["params"][j] for j in self._stackable(g))
            )
            if not fresh:
                return
        self._divided = self._divisions()
        self._buckets = make_buckets(
            [(g, self._stackable(g)) for g in self.param_groups],
            self.state,
            self._state_dtype,
            None if self._divided is None else self._divided.admit,
            self._placed,
            lambda g, j: whole_task(self, g, j),
        )

    def _divisions(self) -> Divisions | None:
        """How ``divide_work``'s replicas divide each bucket (None without it)."""
        if self._replicas is None:
            return None
        device = next((p.device.type for g in self.param_groups for p in g["params"]), "cpu")
        return Divisions(self._replicas, resolve_cost_model(self.cost_model, device), self.overlap)

    @_host_side
    def _check_gradients(self) -> None:
        check_gradients(self.param_groups)

    @_host_side
    def _step_peers(self) -> None:
        step_peers(self.param_groups, self._peers, self.state)

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
        ``cores`` each bucket's tensor work runs compiled (:class:`~.cores.Cores`); the
        parameters outside buckets step eagerly."""
        last_flags: list[tuple[list[str], torch.Tensor]] = []
        stacked = self._buckets
        covered: set[int] = set()
        if stacked is not None:
            covered = stacked.covered
            divided = self._divided
            for bucket in stacked.matrix:
                # a divided or sharded bucket's collectives sit inside the core: it runs eagerly
                if bucket.sharded:
                    run_bucket(bucket, lrs, last_flags, self._skip_counter(), bucket.map_fn or distribute.factored_map)
                elif bucket.division == "local" or divided is None:
                    run_bucket(bucket, lrs, last_flags, self._skip_counter(), distribute.factored_map, cores)
                else:
                    run_bucket(bucket, lrs, last_flags, self._skip_counter(), divided.map_fn(bucket.division))
            for part in stacked.adamw:
                run_adamw(part, lrs[part.index], last_flags, cores)
        return last_flags + per_parameter.step(self, lrs, covered)

    def _placed(self, group: dict, j: int) -> Placed | None:
        """How a sharded member of ``group`` joins a bucket (:mod:`.sharded_buckets`), None for a local one."""
        return placed_member(self, group, j)

    def _sharding(self, p: torch.Tensor) -> Sharding:
        if id(p) not in self._shardings:
            self._shardings[id(p)] = describe_sharding(p)
        return self._shardings[id(p)]

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


__all__ = [
    "EquivariantOptimizer",
    "NonFiniteGradientError",
    "UnsupportedTensorError",
    "COMPLEX_RULES",
    "ELEMENTWISE_RULES",
    "MATRIX_RULES",
]
