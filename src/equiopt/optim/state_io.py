"""Loading a state dict, all or nothing: every group's settings and layouts and every state
tensor's shape are checked before anything changes; older formats load (a setting that did
not exist keeps this optimizer's value, an AdamW ``step`` saved as a number becomes a
tensor, NorMuon's flat row moments are reshaped); the saved state dtypes are kept so a round
trip is exact."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..distributed.placements import is_dtensor
from ..layouts import parse_layout
from .errors import UnsupportedTensorError
from .param_groups import check_flags
from .row_moments import ROW_MOMENT, row_moment_shape
from .rules import rule_named, rule_of, validate_group
from .validate import is_default, saved_param_names

if TYPE_CHECKING:
    from .engine import EquivariantOptimizer


def load_state_dict(opt: EquivariantOptimizer, state_dict: dict, torch_load: Callable[[dict], None]) -> None:
    """:meth:`~.engine.EquivariantOptimizer.load_state_dict`: the pre-hooks, then every check,
    then ``torch_load`` (torch's own loading) on the checked state dict, then the saved state
    dtypes and the counters put back and the buckets made again."""
    sd = dict(state_dict)
    for hook in list(opt._optimizer_load_state_dict_pre_hooks.values()):
        changed = hook(opt, sd)
        if changed is not None:
            sd = dict(changed)
    sd.pop("nonfinite_steps", None)  # older format: a host counter, now per parameter in state
    skips = sd.pop("nonfinite_updates", None)
    groups = [dict(g) for g in sd["param_groups"]]
    if len(groups) != len(opt.param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    ids, params = [], []
    owner_rule: dict[int, tuple] = {}
    for index, (group, own) in enumerate(zip(groups, opt.param_groups)):
        where = f"param_groups[{index}]"
        if len(group["params"]) != len(own["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
            )
        for key, value in own.items():
            if key not in ("params", "names", "param_names"):
                group.setdefault(key, value)  # a state_dict from before a setting existed: keep this one's
        validate_group(group, where)
        check_flags(group, where)
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
            if p.is_complex() and not rule_of(group).complex:
                raise UnsupportedTensorError(
                    f"{where}: rule {group['rule']!r} does not support complex parameters: parameter "
                    f"{name!r} has dtype {p.dtype}"
                )
            try:
                layout = parse_layout(spec)
                if rule_of(group).kind == "matrix":
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
            if key == ROW_MOMENT and torch.is_tensor(value) and rule_named(owner_rule[id(p)][0]).row_moments:
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
        device = next((p.device for g in opt.param_groups for p in g["params"]), skips.device)
        opt._update_skips = skips.detach().to(device=device, dtype=torch.float32, copy=True)
    opt._buckets, opt._eligible = None, {}
    hooks = opt._optimizer_load_state_dict_pre_hooks
    opt._optimizer_load_state_dict_pre_hooks = OrderedDict()  # they ran above
    try:
        torch_load(sd)
    finally:
        opt._optimizer_load_state_dict_pre_hooks = hooks
    # torch casts floating state to each parameter's dtype; keep the saved dtypes
    # (float32 moments of bfloat16 parameters) so a round trip is exact, and keep
    # the counters on the parameter's device so the step never mixes devices.
    for i, p in zip(ids, params):
        for key, value in saved.get(i, {}).items():
            if torch.is_tensor(value) and value.is_floating_point():
                opt.state[p][key] = value.to(device=p.device, dtype=value.dtype, copy=True)
        state = opt.state.get(p)  # (no empty entry for a parameter without state)
        if state and "nonfinite" not in state:
            state["nonfinite"] = torch.zeros((), dtype=torch.float32, device=p.device)
    opt._refresh_buckets()  # stack the loaded state now
