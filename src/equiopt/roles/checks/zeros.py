"""Filling all-zero parameters (zero-initialised biases, output projections, heads) with
small random values for the duration of the checks, which cannot see them otherwise."""

from __future__ import annotations

import torch
from torch import Tensor, nn

_FILL_STD = 0.02


def _fill_zero_parameters(model: nn.Module, gen: torch.Generator) -> list[tuple[nn.Parameter, Tensor]]:
    """Fill every all-zero floating-point parameter with N(0, _FILL_STD^2); return the originals."""
    saved, seen = [], set()
    for p in model.parameters():
        if id(p) in seen or not p.is_floating_point() or p.numel() == 0 or bool(p.detach().any()):
            continue
        seen.add(id(p))
        saved.append((p, p.detach().clone()))
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * _FILL_STD
        p.copy_(noise.to(device=p.device, dtype=p.dtype))
    return saved
