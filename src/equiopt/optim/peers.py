"""torch's own optimizers as rules: the outside reference arms of a comparison.

A comparison that only ever runs equiopt's own code cannot tell a reader whether
equiopt's Muon or AdamW matches the implementations everyone else uses. The peer rules
hand a param group to torch's optimizer classes, unchanged:

``torch_adamw``
    ``torch.optim.AdamW`` (fused when every parameter of the group is on CUDA, foreach
    otherwise) with the group's ``lr``, ``betas``, ``adam_eps`` and ``weight_decay``.
``torch_muon``
    ``torch.optim.Muon`` (torch >= 2.9; its quintic Newton-Schulz iteration in bfloat16,
    whose products on a CPU without bfloat16 hardware run as float32 products rounded to
    bfloat16, :func:`equiopt.linalg.polar.bfloat16_products`: the same
    arithmetic, many times faster there)
    with the group's ``lr``, ``beta`` (momentum), ``nesterov``, ``steps`` (``ns_steps``),
    ``weight_decay`` and ``lr_scale`` (``"spectral"``: torch's ``"original"``,
    ``sqrt(max(1, rows/cols))``; ``"match_adamw"``: its ``"match_rms_adamw"``). It steps
    whole 2-D matrices only: a group with a stacked or sharded parameter is refused by name.

The inner optimizer keeps its state in the outer optimizer's ``state`` (torch's own keys:
``step``, ``exp_avg``, ``exp_avg_sq``; ``momentum_buffer``), so ``state_dict``,
distributed checkpoints and resumption work as for every other rule; learning-rate
schedules act on the outer group and are copied in before each step. Peers behave as
torch does: no skipping of non-finite gradients (the training loop stops a run whose
loss is not finite) and no division of work among replicas.
"""

from __future__ import annotations

from typing import Any

import torch

from ..linalg.polar import bfloat16_products
from .fields import PEER_RULES

__all__ = ["PEER_RULES", "build_peer", "step_peer", "check_peer_param"]

_MUON_LR_FN = {"spectral": "original", "match_adamw": "match_rms_adamw"}


def _muon_class():
    cls = getattr(torch.optim, "Muon", None)
    if cls is None:
        raise ValueError(
            f"rule 'torch_muon' needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}: "
            "use rule 'spectral' (equiopt's Muon) or a newer torch"
        )
    return cls


def check_peer_param(rule: str, p: torch.Tensor, name: str, sharded: bool) -> None:
    """Refuse, by name, a parameter a peer rule cannot step."""
    if rule != "torch_muon":
        return
    _muon_class()
    if p.ndim != 2:
        raise ValueError(
            f"parameter {name!r} has shape {tuple(p.shape)}: rule 'torch_muon' (torch.optim.Muon) steps 2-D "
            "matrices only; give stacked experts rule 'spectral' (equiopt's Muon, one map per expert)"
        )
    if sharded:
        raise ValueError(
            f"parameter {name!r} is sharded: rule 'torch_muon' (torch.optim.Muon) needs whole matrices; "
            "use rule 'spectral' (equiopt's Muon), which steps sharded parameters"
        )


def _hyper(group: dict) -> dict[str, Any]:
    """The inner optimizer's settings from the outer group's (read every step: schedules
    and users may change them)."""
    common = {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"])}
    if group["rule"] == "torch_adamw":
        return {**common, "betas": tuple(group["betas"]), "eps": float(group["adam_eps"])}
    return {
        **common,
        "momentum": float(group["beta"]),
        "nesterov": bool(group["nesterov"]),
        "ns_steps": int(group["steps"]),
        "adjust_lr_fn": _MUON_LR_FN[group["lr_scale"]],
    }


def build_peer(group: dict) -> torch.optim.Optimizer:
    """torch's optimizer for ``group`` (a peer rule's param group, settings filled in)."""
    params = list(group["params"])
    hyper = _hyper(group)
    if group["rule"] == "torch_adamw":
        on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
        kernel: dict[str, Any] = {"fused": True} if on_cuda else {"foreach": True}
        return torch.optim.AdamW(params, **hyper, **kernel)
    if group["rule"] == "torch_muon":
        return _muon_class()(params, **hyper)
    raise ValueError(f"unknown peer rule {group['rule']!r}; valid: {', '.join(PEER_RULES)}")


def step_peer(inner: torch.optim.Optimizer, group: dict, state) -> None:
    """One step of ``inner`` with ``group``'s current settings, its state kept in ``state``."""
    inner.state = state
    inner.param_groups[0].update(_hyper(group))
    params = group["params"]
    if group["rule"] == "torch_muon" and params:
        with bfloat16_products(params[0].device):
            inner.step()
    else:
        inner.step()


def step_peers(param_groups: list[dict], cache: dict, state) -> None:
    """Step the groups of the peer rules with torch's own optimizers (eager), each built once
    and kept in ``cache`` by group position, rule and parameters."""
    for index, group in enumerate(param_groups):
        if group["rule"] not in PEER_RULES:
            continue
        key = (group["rule"], tuple(id(p) for p in group["params"]))
        cached = cache.get(index)
        if cached is None or cached[0] != key:
            cached = cache[index] = (key, build_peer(group))
        inner = cached[1]
        step_peer(inner, group, state)
