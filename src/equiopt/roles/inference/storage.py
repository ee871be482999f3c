"""How a module stores its weight: ``nn.Linear`` ``(out, in)``, transformers' ``Conv1D``
``(in, out)``, an unknown module by the hidden size, and convolution weights (a
``Flatten`` layout, one block per group)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ...layouts import Flatten


class _Orientation(NamedTuple):
    """How a 2-D weight is stored: ``storage`` (``"out_in"``, ``"in_out"`` or ``"unknown"``)
    and the output and input widths of the map it applies."""

    storage: str
    out_features: int
    in_features: int


def _storage(module: nn.Module, attr: str) -> str:
    """``"out_in"`` (nn.Linear), ``"in_out"`` (Conv1D) or ``"unknown"`` for a 2-D weight."""
    if isinstance(module, nn.Linear) and attr == "weight":
        return "out_in"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and attr == "weight":
        return "in_out"
    return "unknown"


def _orientation(module: nn.Module, attr: str, p: torch.Tensor, hidden: int | None) -> _Orientation:
    """(storage, out, in) of a 2-D weight; storage may be 'unknown' (then shapes decide:
    the axis of size ``hidden`` is the input when the other is not)."""
    st = _storage(module, attr)
    a, b = p.shape[-2], p.shape[-1]
    if st == "in_out":
        return _Orientation(st, b, a)
    if st == "out_in":
        return _Orientation(st, a, b)
    if hidden is not None and b == hidden and a != hidden:
        return _Orientation("out_in", a, b)
    if hidden is not None and a == hidden and b != hidden:
        return _Orientation("in_out", b, a)
    return _Orientation("unknown", a, b)


CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONVS = CONVS  # its former name


class _ConvLayout(NamedTuple):
    """The layout of a convolution weight and the reason that describes its axes."""

    layout: Flatten
    reason: str


def _conv(module: nn.Module, attr: str, p: torch.Tensor) -> _ConvLayout | None:
    """``(layout, reason)`` of a convolution weight, else None."""
    if not isinstance(module, CONVS) or attr != "weight" or p.ndim < 3:
        return None
    kernel, groups = tuple(p.shape[2:]), int(getattr(module, "groups", 1) or 1)
    if p.shape[0] % groups:
        return None
    cls = type(module).__name__
    k = "x".join(map(str, kernel))
    if getattr(module, "transposed", False):
        what = f"{cls} weight (in {p.shape[0]}, out/groups {p.shape[1]}, kernel {k}): rows = input channels"
    else:
        what = f"{cls} weight (out {p.shape[0]}, in/groups {p.shape[1]}, kernel {k}): rows = output channels"
    if groups == 1:
        return _ConvLayout(Flatten(kernel), f"{what}, work = rows x (channels*kernel)")
    depthwise = " (depthwise: one filter per channel)" if p.shape[0] == groups else ""
    return _ConvLayout(Flatten(kernel, groups), f"{what}, one block per group of {groups}{depthwise}")
