"""A parameter's optimizer state, made at its first step (or at construction with
``eager_state``): AdamW's step and two moments, or the momentum (and NorMuon's row second
moments, laid out as its work matrices' rows, a DTensor of the parameter's placements),
and the counter of skipped steps; in float32 (float64 for float64 parameters) unless
``state_dtype`` says otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..distributed.placements import is_dtensor
from .row_moments import ROW_MOMENT, row_moment_block, row_moment_placements, row_moment_shape
from .rules import rule_of
from .sharded import local

if TYPE_CHECKING:
    from .engine import EquivariantOptimizer


def init_state(opt: EquivariantOptimizer, p: torch.Tensor, group: dict) -> dict:
    state = opt.state[p]
    rule = rule_of(group)
    if state or rule.kind == "peer":  # a peer's torch optimizer makes its own
        if state and rule.row_moments and ROW_MOMENT not in state:
            row_moment(opt, p, group, state)  # state of another rule: its rows start at zero
        return state
    dtype = state_dtype(opt, p)
    if "exp_avg_sq" in rule.state:  # AdamW's step count, then its moments
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    for name in rule.state:
        state[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    if rule.row_moments:
        row_moment(opt, p, group, state)
    state["nonfinite"] = torch.zeros((), dtype=torch.float32, device=p.device)
    return state


def row_moment(opt: EquivariantOptimizer, p: torch.Tensor, group: dict, state: dict) -> None:
    """The row second moments of ``p`` (a rule with :attr:`Rule.row_moments`, NorMuon's),
    zeros: one per row of each work matrix."""
    j = next(k for k, q in enumerate(group["params"]) if q is p)
    layout, dtype = group["layouts"][j], state_dtype(opt, p)
    shape = row_moment_shape(layout, tuple(p.shape))
    if not is_dtensor(p):
        state[ROW_MOMENT] = torch.zeros(shape, dtype=dtype, device=p.device)
        return
    from torch.distributed.tensor import DTensor

    placements = row_moment_placements(p.placements, layout, tuple(p.shape))  # type: ignore[attr-defined]
    mine = row_moment_block(layout, tuple(p.shape), opt._sharding(p).block)
    stride = torch.empty(shape, device="meta").stride()
    zeros = torch.zeros(mine, dtype=dtype, device=local(p).device)
    mesh = p.device_mesh  # type: ignore[attr-defined]
    state[ROW_MOMENT] = DTensor.from_local(zeros, mesh, placements, shape=torch.Size(shape), stride=stride)


def state_dtype(opt: EquivariantOptimizer, p: torch.Tensor) -> torch.dtype:
    """The dtype of ``p``'s momentum and moments: ``state_dtype``, or float32 (float64 for
    float64 parameters); for a complex parameter the complex dtype of that precision."""
    wide = p.dtype in (torch.float64, torch.complex128)
    dtype = opt.state_dtype or (torch.float64 if wide else torch.float32)
    if p.is_complex():
        return torch.complex128 if dtype == torch.float64 else torch.complex64
    return dtype
