"""A param group made ready to step: its settings validated, each parameter's dtype,
placement, layout and work views checked (by name), its layouts parsed, and the process
groups its sharded step will use created, in the same order on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..distributed.placements import Sharding, describe_sharding, mesh_group
from ..layouts import Layout, parse_layout
from .errors import UnsupportedTensorError
from .peers import check_peer_param
from .row_moments import stage_axes
from .rules import RuleNames, rule_of, validate_group
from .sharded import Plan
from .validate import names_of

if TYPE_CHECKING:
    from .engine import EquivariantOptimizer


#: Rules that step complex parameters, as torch's AdamW and SGD do: as their real views
#: (``torch.view_as_real``), every operation being element-wise.
COMPLEX_RULES = RuleNames(lambda r: r.complex)

#: torch's optimizer flags that would change what a step computes; this optimizer does not
#: offer them, so a param group asking for one is refused rather than silently ignored.
UNOFFERED_FLAGS = {
    "maximize": "minimise the negated loss instead",
    "differentiable": "the step runs under torch.no_grad and is not differentiable",
}


def check_views(p: torch.Tensor, layout: Layout, name: str) -> None:
    """The step writes updates through the work views of a parameter, so they must alias it."""
    if p.device.type == "meta" or not isinstance(p, torch.Tensor) or type(p.data) is not torch.Tensor:
        return
    base = p.untyped_storage().data_ptr()
    if any(v.untyped_storage().data_ptr() != base for v in layout.to_work_list(p.detach(), name=name)):
        raise ValueError(
            f"parameter {name!r}: layout {layout!r} copies the tensor; it must only reshape, transpose or slice"
        )


def check_flags(group: dict, where: str) -> None:
    """Refuse torch's ``maximize=True`` and ``differentiable=True`` in a param group, by name."""
    for flag, instead in UNOFFERED_FLAGS.items():
        if group.get(flag):
            raise ValueError(
                f"{where}, field {flag!r}: EquivariantOptimizer does not offer {flag}=True ({instead}); "
                f"leave it out or set it to False"
            )


def prepare_group(opt: EquivariantOptimizer, group: dict, index: int) -> None:
    where = f"param_groups[{index}]"
    validate_group(group, where)
    check_flags(group, where)
    params = group["params"]
    group["names"] = names = names_of(group, where)  # param_names, else places; not saved
    per_param = group.get("layouts")
    if per_param is not None and len(per_param) != len(params):
        raise ValueError(f"{where}: 'layouts' has {len(per_param)} entries for {len(params)} parameters")
    layouts = []
    rule = group["rule"]
    for j, p in enumerate(params):
        if p.is_complex():
            if not rule_of(group).complex:
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
        sharding = opt._shardings[id(p)] = describe_sharding(p, names[j])
        spec = group["layout"] if per_param is None or per_param[j] is None else per_param[j]
        try:
            layout = parse_layout(spec)
        except ValueError as err:
            raise ValueError(f"parameter {names[j]!r}: {err}") from None
        if rule_of(group).kind == "peer":
            check_peer_param(group["rule"], p, names[j], sharding.kind == "sharded" and sharding.is_sharded)
        if rule_of(group).kind == "matrix":
            if p.ndim < 2 and layout.ndim != p.ndim:
                raise ValueError(
                    f"parameter {names[j]!r} has shape {tuple(p.shape)}: rule {group['rule']!r} needs a matrix "
                    f"(it only supports parameters of 2 or more dimensions, or a flat one with layout "
                    "'unflatten:ROWS'); give vectors and scalars rule 'adamw' or 'sgd'"
                )
            layout.check(tuple(p.shape), names[j])
            check_views(p, layout, names[j])
            how = opt.plan_of(group, layout, sharding)
            if rule_of(group).row_moments and sharding.kind == "sharded":
                if how.how == "owner":  # the groups of its row stage's sums
                    for axes in stage_axes(layout, sharding):
                        if axes:
                            mesh_group(sharding.mesh, axes)
            make_groups(how, sharding)
        layouts.append(layout)
    group["layouts"] = layouts


def make_groups(how: Plan, sharding: Sharding) -> None:
    """Create, at construction and in the same order on every rank, the process groups
    a parameter's step will use (products of mesh axes are made by a collective call)."""
    if sharding.kind != "sharded" or not sharding.is_sharded:
        return
    mesh_group(sharding.mesh, sharding.split_axes)
    within = tuple(a for a in how.axes if a not in how.replicas)  # owner work that replicas repeat
    for axes in (how.row_sum_axes, how.cols) if how.how == "reduce" else (how.axes, within):
        if axes:
            mesh_group(sharding.mesh, axes)


def check_gradients(param_groups: list[dict]) -> None:
    """Refuse sparse gradients, by rule and parameter name, before anything is stepped
    (torch's optimizers raise a RuntimeError for those they do not support)."""
    for group in param_groups:
        for j, p in enumerate(group["params"]):
            grad = p.grad
            if grad is not None and grad.layout != torch.strided:
                raise UnsupportedTensorError(
                    f"rule {group['rule']!r} does not support sparse gradients: parameter "
                    f"{group['names'][j]!r} has a gradient of layout {grad.layout}; make it dense "
                    "(p.grad = p.grad.to_dense(), or nn.Embedding(sparse=False))"
                )
