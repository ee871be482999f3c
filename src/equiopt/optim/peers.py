"""Stepping the peer rules: torch's own optimizers as the outside reference arms of a comparison.

The peer rules' own module is :mod:`equiopt.optim.rules.peers`; this one steps them."""

from __future__ import annotations

import torch

from .fields import PEER_RULES
from .rules import PeerRule, rule_named

__all__ = ["PEER_RULES", "build_peer", "step_peer", "step_peers", "check_peer_param"]


def _peer(rule: str) -> PeerRule:
    found = rule_named(rule)
    if not isinstance(found, PeerRule):
        raise ValueError(f"unknown peer rule {rule!r}; valid: {', '.join(PEER_RULES)}")
    return found


def check_peer_param(rule: str, p: torch.Tensor, name: str, sharded: bool) -> None:
    """Refuse, by name, a parameter a peer rule cannot step."""
    _peer(rule).check_param(p, name, sharded)


def build_peer(group: dict) -> torch.optim.Optimizer:
    """torch's optimizer for ``group`` (a peer rule's param group, settings filled in)."""
    return _peer(group["rule"]).build(group)


def step_peer(inner: torch.optim.Optimizer, group: dict, state) -> None:
    """One step of ``inner`` with ``group``'s current settings, its state kept in ``state``."""
    rule = _peer(group["rule"])
    inner.state = state
    inner.param_groups[0].update(rule.hyper(group))
    rule.step(inner, group)


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
