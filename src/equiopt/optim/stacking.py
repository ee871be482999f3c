"""Which parameters a bucket may hold (:mod:`.buckets`): plain local tensors of the matrix
rules with one work tensor each, not ``lazy``, and of ``adamw``, and sharded ones that
:mod:`.sharded_buckets` places, in groups that skip
non-finite gradients (a bucket that ``divide_work``'s replicas cannot divide by matrices is
then declined, :mod:`.divided`); everything else takes the per-parameter step
(:mod:`.per_parameter`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .rules import map_key, rule_of

if TYPE_CHECKING:
    from .engine import EquivariantOptimizer


def stackable(opt: EquivariantOptimizer, group: dict) -> list[int]:
    """Positions of ``group``'s parameters whose state a bucket may stack (see
    :mod:`.buckets`): plain tensors of the matrix rules (one work tensor each, not
    ``lazy``) and of ``adamw``, when the group skips non-finite gradients; each once it has state
    or a gradient."""
    rule = rule_of(group)
    key = map_key(group) if rule.kind == "matrix" else None  # (a sharded member's plan depends on it)
    settings = (group["rule"], group["nonfinite"], group["lazy"], len(group["params"]), key)
    cached = opt._eligible.get(id(group))
    if cached is None or cached[0] != settings:
        cached = opt._eligible[id(group)] = (settings, eligible_members(opt, group))
    params = group["params"]
    return [j for j in cached[1] if params[j].grad is not None or opt.state.get(params[j])]


def eligible_members(opt: EquivariantOptimizer, group: dict) -> list[int]:
    rule = rule_of(group)
    if (
        group["nonfinite"] != "skip"
        or group["lazy"]
        or not (rule.kind == "matrix" or rule.adam and rule.kind != "peer")
    ):
        return []
    out = []
    for j, p in enumerate(group["params"]):
        kind = opt._sharding(p).kind
        if p.numel() == 0 or p.is_complex():  # (a complex one is stepped as its real view, on the per-parameter path)
            continue
        if kind == "sharded":
            if opt._placed(group, j) is None:
                continue
        elif kind != "local" or type(p.data) is not torch.Tensor:
            continue
        if not rule.adam and group["layouts"][j].num_blocks != 1:
            continue
        out.append(j)
    return out
