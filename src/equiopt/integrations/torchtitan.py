"""torchtitan integration: equiopt as the optimizer of torchtitan's ``Trainer`` (torchtitan >= 0.3).

torchtitan builds its optimizers in ``OptimizersContainer``: every ``ParamGroupConfig``
(a regex on parameter names, an optimizer name, keyword arguments) claims parameters, and
the container calls the factory of each optimizer name once per model part with the
groups that name got (each group carries ``params``, ``param_names`` and the container's
``fused`` / ``foreach``). :class:`EquioptOptimizersContainer` resolves the name
``"equiopt"`` to :func:`build_optimizer_from_groups`, which drops ``fused`` / ``foreach``,
infers the role and layout of every parameter from the model part that holds it (its
module structure, as :func:`equiopt.assign_roles` does), and regroups the parameters one
group per role with the recipe's rule and settings, keyed by torchtitan's canonical names
so that checkpoints find them. Parameters may be DTensors on any mesh
:class:`~equiopt.EquivariantOptimizer` supports (FSDP2, TP, HSDP, EP, and their products).

In a config-registry function, or wherever a ``Trainer.Config`` is made::

    from equiopt.integrations.torchtitan import equiopt_config

    def llama3_8b_equiopt() -> Trainer.Config:
        config = llama3_8b()
        config.optimizer = equiopt_config(recipe="equiopt:default")
        return config

The recipe and a learning-rate multiplier are fields of the config, so torchtitan's
command line sets them (``--optimizer.recipe paper:qwen3:b-ii --optimizer.lr_multiplier
0.5``); overrides, role rules and engine options travel in
``optimizer_factory_kwargs_by_name["equiopt"]`` (as torchtitan's Kimi config wires its
DistMuon); the keyword
arguments of a ``ParamGroupConfig`` naming ``"equiopt"`` are recipe overrides for the
parameters its pattern claims (``{"weight_decay": 0.0}`` for every role, or
``{"router": {"lr": 1e-3}}`` by role). Other names (``"AdamW"``, ...) keep torchtitan's
own factories, so a config may leave some parameters to them.

The recipe gives every role its base learning rate; torchtitan's ``lr_scheduler``
(warm-up, decay) multiplies them all, in place of the recipe's per-role schedules.
``state_dict()`` is torchtitan's flat, name-keyed dict; optimizer state is created at
construction (``eager_state=True``) so that every rank's checkpoint has the same keys
from step 0 and no zero-gradient step is needed to create it.

``equiopt roles torchtitan:MODEL[:FLAVOR]`` prints the roles of torchtitan's models
(:func:`build_model`, :func:`role_table`). Where triton is not installed (CPU-only
torch), importing this module lets torchtitan's models import anyway: their triton
kernels (used by expert parallelism on CUDA) are replaced by stand-ins that fail if called.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from ..optim import EquivariantOptimizer
from ..recipes import DEFAULT_RECIPE, ROLES, Recipe, get_recipe, register_recipe
from ..roles import RoleTable, assign_roles
from ..roles.dataflow import register_trace_forward

__all__ = [
    "OPTIMIZER_NAME",
    "EquioptOptimizersContainer",
    "equiopt_config",
    "build_optimizer_from_groups",
    "model_rules",
    "role_table",
    "build_model",
]

#: The optimizer name a ``ParamGroupConfig`` gives to hand its parameters to equiopt.
OPTIMIZER_NAME = "equiopt"

# what torchtitan's container adds to every group, for torch's own optimizers
_IMPLEMENTATION_KEYS = ("fused", "foreach")
# per-parameter lists in a group: kept out of the flat, name-keyed checkpoint (torchtitan
# files every group key under each of the group's names), taken from the live groups on load
_PER_PARAMETER_KEYS = ("names", "layouts")
# engine options a factory call accepts besides the recipe and role options
_ENGINE_OPTIONS = ("eager_state", "compile", "state_dtype", "divide_work", "cost_model")
_ROLE_OPTIONS = ("dims", "gate_up", "per_head")


# ----------------------------------------------------------------------- roles


def model_rules(model: nn.Module) -> dict[str, tuple[str, str]]:
    """Role rules for conventions of torchtitan's models that their modules do not declare.

    gpt-oss keeps each expert's gate and up rows fused and interleaved in
    ``mlp1_weight_EGD`` (its SwiGLU reads ``h[..., ::2]`` and ``h[..., 1::2]``).

    Args:
        model: a torchtitan model.

    Returns:
        ``{regex: (role, layout)}`` for :func:`equiopt.assign_roles`'s ``rules``.
    """
    rules = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "GptOssGroupedExperts" and isinstance(
            getattr(module, "mlp1_weight_EGD", None), torch.Tensor
        ):
            prefix = f"{name}." if name else ""
            rules[f"^{re.escape(prefix)}mlp1_weight_EGD$"] = ("mlp_in", "experts:gate_up:interleave")
    return rules


def _merged_rules(model: nn.Module, rules: Any) -> list[tuple[str, Any]]:
    """The user's rules first (the first match wins), then :func:`model_rules`."""
    mine = list(rules.items() if isinstance(rules, Mapping) else rules or ())
    return mine + list(model_rules(model).items())


def role_table(model: nn.Module, rules: Any = None, **role_options: Any) -> RoleTable:
    """:func:`equiopt.assign_roles` for a torchtitan model (bare, or parallelised and wrapped),
    with :func:`model_rules` after ``rules``.

    Args:
        model: a torchtitan model.
        rules: the user's rules, matched before :func:`model_rules`.
        **role_options: further options of :func:`equiopt.assign_roles`.

    Returns:
        The :class:`~equiopt.roles.RoleTable`.
    """
    return assign_roles(model, rules=_merged_rules(model, rules), **role_options)


# ------------------------------------------------------------------ roles trace


def sdpa_in_place_of_masked_attention(self, q, k, v, *, scale=None, **_: Any) -> torch.Tensor:
    """Trace forward of torchtitan's flex and varlen attention (``(batch, tokens, heads,
    head_dim)`` in and out), which need a mask built from real token ids: causal SDPA on
    the same q, k, v, so the roles trace sees what becomes attention's inputs."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


for _cls in ("FlexAttention", "VarlenAttention"):
    register_trace_forward(f"torchtitan.models.common.attention.{_cls}", sdpa_in_place_of_masked_attention)


# --------------------------------------------------------------------- factory


def _as_overrides(kwargs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A ``ParamGroupConfig``'s keyword arguments as recipe overrides: a table per role
    (and ``"*"``) as is, plain fields for every role."""
    if not kwargs:
        return {}
    by_role = {k: v for k, v in kwargs.items() if k in ROLES or k == "*"}
    plain = {k: v for k, v in kwargs.items() if k not in by_role}
    if by_role and any(not isinstance(v, Mapping) for v in by_role.values()):
        raise ValueError(f"{where}: optimizer_kwargs keyed by role need a table of settings per role, got {kwargs!r}")
    out = dict(by_role)
    if plain:
        out["*"] = {**dict(by_role.get("*", {})), **plain}
    return out


def _rows_by_param(part: nn.Module, tables: dict[int, Any], rules: Any, role_options: dict) -> dict[int, Any]:
    """``id(param) -> RoleRow`` of a model part (its role table is made once per part)."""
    found = tables.get(id(part))
    if found is None:
        table = role_table(part, rules=rules, **role_options)
        found = tables[id(part)] = (table, {id(r.param): r for r in table})
    return found[1]


def build_optimizer_from_groups(
    param_groups: list[dict[str, Any]],
    *,
    model: nn.Module | None = None,
    model_parts: list[nn.Module] | None = None,
    recipe: str | Recipe = DEFAULT_RECIPE,
    lr_multiplier: float = 1.0,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    rules: Any = None,
    eager_state: bool = True,
    compile: bool | str | None = None,
    state_dtype: torch.dtype | str | None = None,
    divide_work: Any = None,
    cost_model: Any = None,
    _tables: dict[int, Any] | None = None,
    **role_options: Any,
) -> EquivariantOptimizer:
    """An :class:`~equiopt.EquivariantOptimizer` from torchtitan's param groups.

    ``param_groups`` are the groups torchtitan's container hands a factory:
    ``{"params", "param_names", "fused", "foreach", **optimizer_kwargs}``. The roles come
    from ``model`` (or whichever of ``model_parts`` holds the parameters). The result has
    one group per (input group, role), in the input order and then the order of
    :data:`equiopt.recipes.ROLES`, with the recipe's settings for that role (``overrides``,
    then the input group's ``optimizer_kwargs``, see :func:`_as_overrides`), its ``lr``
    times ``lr_multiplier``, and ``param_names`` (torchtitan's canonical names, the keys
    of its checkpoints). ``rules`` and ``role_options`` (``dims``, ``gate_up``,
    ``per_head``) are those of :func:`equiopt.assign_roles`; the rest are the optimizer's
    options. ``state_dtype`` may be a name (``"bfloat16"``).

    Args:
        param_groups: torchtitan's groups for this optimizer.
        model: the model holding the parameters.
        model_parts: torchtitan's model parts (pipeline stages); the one holding the
            parameters is used.
        recipe: a recipe name, TOML path or :class:`~equiopt.recipes.Recipe`.
        lr_multiplier: scales every role's learning rate.
        overrides: recipe fields per role (``"*"`` for all).
        rules: role overrides by parameter name.
        eager_state: create the optimizer state at construction (torchtitan's checkpoints
            need every key from step 0).
        compile: compile the step (see :class:`~equiopt.optim.EquivariantOptimizer`).
        state_dtype: the dtype of momentum and moments, or its name.
        divide_work: divide the matrix maps among replicas.
        cost_model: how a sharded parameter's plan is chosen.
        **role_options: ``dims``, ``gate_up``, ``per_head``.

    Returns:
        The optimizer, whose groups carry torchtitan's ``param_names``.

    Raises:
        ValueError: when neither ``model`` nor ``model_parts`` is given, for a bad
            ``lr_multiplier`` or ``state_dtype``, or for a bad recipe, override or rule.
        TypeError: for an unknown option in the input groups.
    """
    unknown = [k for k in role_options if k not in _ROLE_OPTIONS]
    if unknown:
        raise TypeError(
            f"equiopt factory: unknown option(s) {', '.join(map(repr, unknown))}; valid: recipe, "
            f"lr_multiplier, overrides, rules, {', '.join(_ROLE_OPTIONS + _ENGINE_OPTIONS)}"
        )
    if not isinstance(lr_multiplier, (int, float)) or isinstance(lr_multiplier, bool) or not lr_multiplier > 0:
        raise ValueError(f"equiopt factory: lr_multiplier must be a positive number, got {lr_multiplier!r}")
    if isinstance(state_dtype, str):
        resolved = getattr(torch, state_dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"equiopt factory: state_dtype {state_dtype!r} is not a torch dtype")
        state_dtype = resolved
    base = get_recipe(recipe)
    if overrides:
        base = base.with_overrides(overrides)
    parts = [model] if model is not None else list(model_parts or ())
    if not parts:
        raise ValueError("equiopt factory: pass the model (or the model parts) whose parameters the groups hold")
    tables = _tables if _tables is not None else {}
    owners = {id(q): part for part in reversed(parts) for q in part.parameters()}
    groups: list[dict[str, Any]] = []
    sources: list[int] = []
    for index, given in enumerate(param_groups):
        where = f"equiopt param group {index}"
        params = list(given["params"])
        names = given.get("param_names")
        if names is None:
            names = [f"{where}.params[{j}]" for j in range(len(params))]
        if len(names) != len(params):
            raise ValueError(f"{where}: {len(names)} param_names for {len(params)} parameters")
        kwargs = {k: v for k, v in given.items() if k not in ("params", "param_names", *_IMPLEMENTATION_KEYS)}
        try:
            rec = base.with_overrides(_as_overrides(kwargs, where)) if kwargs else base
        except ValueError as err:
            raise ValueError(f"{where} (parameters {names[0]!r}, ...): {err}") from None
        by_role: dict[str, list[tuple[torch.Tensor, str, Any]]] = {role: [] for role in ROLES}
        for p, name in zip(params, names):
            part = owners.get(id(p))
            if part is None:
                raise ValueError(f"parameter {name!r} is in none of the model parts the optimizer was given")
            row = _rows_by_param(part, tables, rules, role_options).get(id(p))
            if row is None:
                raise ValueError(f"parameter {name!r} has no role: it does not require grad in its model part")
            by_role[row.role].append((p, name, row.layout if row.layout is not None else "row"))
        for role, members in by_role.items():
            if not members:
                continue
            settings = rec.settings(role)
            settings["lr"] = settings["lr"] * lr_multiplier
            groups.append(
                {
                    **settings,
                    "params": [m[0] for m in members],
                    "param_names": [m[1] for m in members],
                    "names": [m[1] for m in members],
                    "layouts": [m[2] for m in members],
                    "role": role,
                }
            )
            sources.append(index)
    optimizer = EquivariantOptimizer(
        groups,
        eager_state=eager_state,
        compile=compile,
        state_dtype=state_dtype,
        divide_work=divide_work,
        cost_model=cost_model,
    )
    optimizer.recipe = base
    optimizer.role_tables = [tables[id(p)][0] for p in parts if id(p) in tables]
    optimizer.source_groups = sources  # which input group each group came from (for logs)
    return optimizer


# ------------------------------------------------------------------- container


class EquioptOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also knows the optimizer name ``"equiopt"``.

    Build it from its ``Config`` (``equiopt_config(...)`` makes one), as the Trainer does:
    ``config.optimizer.build(model_parts=model_parts)``.

    Args:
        config (Config): the container's config, with the ``recipe`` and ``lr_multiplier`` fields.
        model_parts: torchtitan's model parts.

    Raises:
        ValueError: when ``optimizer_factory_kwargs_by_name`` sets ``recipe`` or
            ``lr_multiplier`` for equiopt (they are the config's own fields).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        param_groups: list[ParamGroupConfig] = field(
            default_factory=lambda: [ParamGroupConfig(pattern=r".*", optimizer_name=OPTIMIZER_NAME)]
        )
        """Per-parameter-group optimizer configurations (first match wins); by default
        every parameter goes to equiopt."""

        recipe: str = DEFAULT_RECIPE
        """equiopt recipe: a name (equiopt:default, paper:qwen3:b-ii, ...) or a TOML file."""

        lr_multiplier: float = 1.0
        """Scales the learning rate of every role of the recipe."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        self._role_tables: dict[int, Any] = {}  # one role table per model part, shared by the factory calls
        self._recipe_settings = {"recipe": config.recipe, "lr_multiplier": config.lr_multiplier}
        clash = [
            k for k in self._recipe_settings if k in config.optimizer_factory_kwargs_by_name.get(OPTIMIZER_NAME, {})
        ]
        if clash:
            raise ValueError(
                f"optimizer_factory_kwargs_by_name[{OPTIMIZER_NAME!r}] sets {', '.join(clash)}: set "
                "them on the config's own fields (optimizer.recipe, optimizer.lr_multiplier)"
            )
        super().__init__(config, model_parts=model_parts)

    def _resolve_optimizer_factory(self, name: str):  # an instance method: the factory needs the model parts
        if name == OPTIMIZER_NAME:
            return functools.partial(
                build_optimizer_from_groups,
                model_parts=self.model_parts,
                _tables=self._role_tables,
                **self._recipe_settings,
            )
        try:
            return OptimizersContainer._resolve_optimizer_factory(name)
        except NotImplementedError:
            raise NotImplementedError(
                f"Optimizer {name} not added: this container knows {OPTIMIZER_NAME!r} and "
                "torchtitan's own names (Adam, AdamW, DistMuon)"
            ) from None

    def _log_optimizer(self, optimizer, part_idx: int, patterns: list[str]) -> None:
        if not isinstance(optimizer, EquivariantOptimizer):
            return super()._log_optimizer(optimizer, part_idx, patterns)
        from torchtitan.tools.logging import logger

        sources = getattr(optimizer, "source_groups", [0] * len(optimizer.param_groups))
        for group, source in zip(optimizer.param_groups, sources):
            logger.info(
                f"Optimizer equiopt (model_part={part_idx}): {len(group['params'])} params "
                f"[{patterns[source]}] role={group['role']} rule={group['rule']} lr={group['lr']:g} "
                f"weight_decay={group['weight_decay']:g}"
            )

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's flat, name-keyed state dict, without the per-parameter group lists.

        Returns:
            The state dict for torchtitan's checkpoints.
        """
        flat = super().state_dict()
        for key in [k for k in flat if k.startswith("param_groups.") and k.rsplit(".", 1)[-1] in _PER_PARAMETER_KEYS]:
            del flat[key]
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`, taking the per-parameter group lists
        (names and layouts) from the live groups.

        Args:
            state_dict: the flat state dict.
        """
        flat = dict(state_dict)
        for optimizer in self.optimizers:
            if not isinstance(optimizer, EquivariantOptimizer):
                continue
            for group in optimizer.param_groups:
                if group["param_names"]:
                    first = group["param_names"][0]
                    flat[f"param_groups.{first}.names"] = list(group["names"])
                    flat[f"param_groups.{first}.layouts"] = [layout.spec for layout in group["layouts"]]
        super().load_state_dict(flat)


def equiopt_config(
    recipe: str | Recipe = DEFAULT_RECIPE,
    lr_multiplier: float = 1.0,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    rules: Any = None,
    pattern: str = r".*",
    param_groups: list[ParamGroupConfig] | None = None,
    implementation: str = "for-loop",
    **options: Any,
) -> EquioptOptimizersContainer.Config:
    """The optimizer config for a torchtitan ``Trainer.Config``: ``config.optimizer = equiopt_config(...)``.

    ``recipe``: a recipe name (``"equiopt:default"``, ``"paper:qwen3:b-ii"``, ...), a TOML
    path or a :class:`~equiopt.recipes.Recipe`; ``lr_multiplier`` scales every role's
    learning rate; ``overrides`` replace recipe fields per role (``"*"`` for all);
    ``rules`` force roles by parameter-name regex (see :func:`equiopt.assign_roles`).
    ``pattern`` picks the parameters equiopt optimizes (default: all);
    ``param_groups`` replaces that single group by your own list (name the equiopt ones
    ``OPTIMIZER_NAME``). ``implementation`` is torchtitan's setting for its own
    optimizers, if ``param_groups`` uses any. ``options``: ``dims``, ``gate_up``,
    ``per_head`` (role inference) and ``eager_state``, ``compile``, ``state_dtype``,
    ``divide_work``, ``cost_model`` (the optimizer's).

    The recipe, overrides and rules are checked here, so a mistake fails when the config
    is made, not when the Trainer builds the optimizer.

    Args:
        recipe: a recipe name, TOML path or :class:`~equiopt.recipes.Recipe`.
        lr_multiplier: scales every role's learning rate.
        overrides: recipe fields per role (``"*"`` for all).
        rules: role overrides by parameter-name regex.
        pattern: the parameters equiopt optimizes.
        param_groups: your own list of ``ParamGroupConfig``, replacing the single group.
        implementation: torchtitan's implementation setting for its own optimizers.
        **options: role-inference and optimizer options (see above).

    Returns:
        The config, for ``config.optimizer``.

    Raises:
        ValueError: for an unknown recipe, override or rule, or a bad ``lr_multiplier``.
        TypeError: for an unknown option.
    """
    unknown = [k for k in options if k not in _ROLE_OPTIONS + _ENGINE_OPTIONS]
    if unknown:
        raise TypeError(
            f"equiopt_config: unknown option(s) {', '.join(map(repr, unknown))}; valid: "
            f"{', '.join(_ROLE_OPTIONS + _ENGINE_OPTIONS)}"
        )
    rec = get_recipe(recipe)
    if isinstance(recipe, Recipe):  # the config holds a name: make this recipe findable by it
        known = _registered(recipe.name)
        if known is None:
            register_recipe(recipe)
        elif known != recipe:
            raise ValueError(
                f"equiopt_config: another recipe named {recipe.name!r} exists; give yours another name "
                "(recipe.with_overrides(name=...))"
            )
        recipe = recipe.name
    elif not isinstance(recipe, str):
        recipe = str(recipe)  # a path
    if not isinstance(lr_multiplier, (int, float)) or isinstance(lr_multiplier, bool) or not lr_multiplier > 0:
        raise ValueError(f"equiopt_config: lr_multiplier must be a positive number, got {lr_multiplier!r}")
    if overrides:
        rec.with_overrides(overrides)
    if rules:
        from ..roles.inference.rules import rule_table

        rule_table(rules)
    if param_groups is None:
        param_groups = [ParamGroupConfig(pattern=pattern, optimizer_name=OPTIMIZER_NAME)]
    elif not any(pg.optimizer_name == OPTIMIZER_NAME for pg in param_groups):
        raise ValueError(f"equiopt_config: no entry of param_groups names the optimizer {OPTIMIZER_NAME!r}")
    factory = dict(options)
    if overrides:
        factory["overrides"] = {k: dict(v) for k, v in overrides.items()}
    if rules:
        factory["rules"] = dict(rules) if isinstance(rules, Mapping) else list(rules)
    return EquioptOptimizersContainer.Config(
        param_groups=list(param_groups),
        implementation=implementation,
        recipe=recipe,
        lr_multiplier=float(lr_multiplier),
        optimizer_factory_kwargs_by_name={OPTIMIZER_NAME: factory},
    )


def _registered(name: str) -> Recipe | None:
    try:
        return get_recipe(name)
    except ValueError:
        return None


# ---------------------------------------------------------------------- models

_TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


class _NeedsTriton(types.ModuleType):
    """Stands in for torchtitan's triton kernels where triton is not installed: importing
    the models works (to inspect or build them on CPU); calling a kernel says why not."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args: Any, **kwargs: Any):
            raise RuntimeError(
                f"{self.__name__}.{name} needs triton, which is not installed (a CUDA build of torch brings it)"
            )

        return unavailable


def _allow_models_without_triton() -> None:
    """torchtitan's models import its triton kernels (for expert parallelism on CUDA);
    where triton is not installed, stand-ins let the models import and build on CPU."""
    if _TRITON_KERNELS not in sys.modules and importlib.util.find_spec("triton") is None:
        sys.modules[_TRITON_KERNELS] = _NeedsTriton(_TRITON_KERNELS)


_allow_models_without_triton()


def _import_models(name: str):
    _allow_models_without_triton()
    return importlib.import_module(f"torchtitan.models.{name}")


def _flavors(module) -> dict[str, Any]:
    return next((v for k, v in vars(module).items() if k.endswith("_configs") and isinstance(v, dict) and v), {})


def build_model(spec: str, device: str | torch.device = "meta") -> nn.Module:
    """A torchtitan model from ``"MODEL[:FLAVOR]"`` (e.g. ``"llama3:8B"``, ``"qwen3:debugmodel_moe"``,
    ``"deepseek_v3:16B"``; flavor ``debugmodel`` by default), built on ``device`` (the meta
    device allocates nothing).

    Args:
        spec: ``"MODEL[:FLAVOR]"``.
        device: where to build it.

    Returns:
        The model.

    Raises:
        ValueError: for an unknown model or flavor.
    """
    from torchtitan.models import _supported_models

    name, _, flavor = spec.partition(":")
    flavor = flavor or "debugmodel"
    if name not in _supported_models:
        raise ValueError(f"unknown torchtitan model {name!r}; torchtitan has {', '.join(sorted(_supported_models))}")
    module = _import_models(name)
    flavors = _flavors(module)
    if flavors and flavor not in flavors:
        raise ValueError(f"torchtitan model {name!r} has no flavor {flavor!r}; it has {', '.join(flavors)}")
    model_spec = module.model_registry(flavor)
    with torch.device(device):
        return model_spec.model.build()
