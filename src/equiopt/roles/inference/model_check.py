"""Checks on what :func:`~equiopt.roles.assign_roles` is given: a module (or a wrapper
module holding the model) with trainable parameters, none hidden in attributes that are
not registered submodules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .errors import RoleInferenceError


def _unregistered_modules(obj: Any) -> list[str]:
    """Attributes of ``obj`` that hold modules without registering them (plain lists,
    tuples, dicts, or set past ``nn.Module.__setattr__``): their parameters are invisible."""
    found = []
    registered = getattr(obj, "_modules", {}) or {}
    for key, value in (vars(obj) if hasattr(obj, "__dict__") else {}).items():
        if key == "_modules" or key in registered:
            continue
        items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, nn.Module) and any(True for _ in v.parameters()) for v in items):
            found.append(key)
    return found


def _check_model(model: Any) -> None:
    """Clear errors for something that is not a model, or a wrapper that hides its model."""
    if not isinstance(model, nn.Module):
        inner = [k for k, v in (vars(model).items() if hasattr(model, "__dict__") else ()) if isinstance(v, nn.Module)]
        hint = (
            f"; it holds one at .{inner[0]}: pass that"
            if len(inner) == 1
            else (f"; it holds modules at {', '.join('.' + k for k in inner)}: pass the model" if inner else "")
        )
        raise TypeError(
            f"expected an nn.Module (the model, or a wrapper module holding it), got {type(model).__name__}{hint}"
        )
    if any(p.requires_grad for p in model.parameters()):
        return
    total = sum(1 for _ in model.parameters())
    hidden = _unregistered_modules(model)
    if hidden:
        raise RoleInferenceError(
            f"{type(model).__name__} reports no trainable parameters, but its attribute(s) "
            f"{', '.join(repr(h) for h in hidden)} hold modules that are not registered as submodules "
            "(a plain list, dict or tuple); pass the model itself, or register it (nn.ModuleList, nn.ModuleDict, "
            "or a plain attribute assignment) so that named_parameters() reports it"
        )
    if total:
        raise RoleInferenceError(
            f"{type(model).__name__} has {total} parameters but none requires grad: nothing to optimize"
        )
    raise RoleInferenceError(
        f"{type(model).__name__} has no parameters: the inner model cannot be found. Pass the model itself, or a "
        "wrapper that registers it as a submodule (DDP's .module, a LightningModule attribute)"
    )
