"""An optimizer's ``param_groups`` as JSON data for ``checkpoint.json``, and back into the
groups of the optimizer being loaded into (plain values, dtypes and scalar tensors are
kept; anything else comes from that optimizer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import CheckpointError


def _to_json(value: Any) -> tuple[bool, Any]:
    """``(ok, value)``: plain data as JSON (tuples as lists, dtypes tagged); ok False for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    if isinstance(value, torch.dtype):
        return True, {"__dtype__": str(value).removeprefix("torch.")}
    if torch.is_tensor(value) and value.ndim == 0 and not hasattr(value, "placements"):  # a tensor lr, say
        return True, {"__scalar__": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        items = [_to_json(v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        items = {k: _to_json(v) for k, v in value.items()}
        return all(ok for ok, _ in items.values()), {k: v for k, (_, v) in items.items()}
    return False, None


def _from_json(value: Any, like: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__dtype__"}:
        return getattr(torch, value["__dtype__"])
    if isinstance(value, dict) and set(value) == {"__scalar__", "dtype"}:
        device = like.device if torch.is_tensor(like) else None
        return torch.tensor(value["__scalar__"], dtype=getattr(torch, value["dtype"]), device=device)
    if isinstance(like, tuple) and isinstance(value, list):
        return tuple(_from_json(v, l) for v, l in zip(value, like)) if len(value) == len(like) else tuple(value)
    return value


def param_groups_to_json(groups: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """An optimizer state dict's ``param_groups`` as JSON data; values that are not plain data
    (a callable, an object) are left out and come from the optimizer being loaded into."""
    out = []
    for group in groups:
        kept = {}
        for key, value in group.items():
            ok, data = _to_json(value)
            if ok:
                kept[key] = data
        out.append(kept)
    return out


def param_groups_from_json(saved: list[Mapping[str, Any]], template: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``template`` (the groups of the optimizer being loaded into) with the saved values put back."""
    if len(saved) != len(template):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
            f"{len(template)}; resume with the recipe and model the run was started with"
        )
    out = []
    for i, (old, new) in enumerate(zip(saved, template)):
        if "params" in old and list(old["params"]) != list(new["params"]):
            raise CheckpointError(
                f"parameter group {i} ({new.get('role', '?')}) holds other parameters than in the "
                f"checkpoint; resume with the recipe and model the run was started with"
            )
        merged = dict(new)
        for key, value in old.items():
            if key != "params":
                merged[key] = _from_json(value, new.get(key))
        out.append(merged)
    return out
