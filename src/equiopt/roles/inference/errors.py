"""The error role inference raises, and the ``rules=`` fix it proposes for a tensor of
more than two axes."""

from __future__ import annotations

import re

import torch


class RoleInferenceError(ValueError):
    """A parameter whose role or storage convention cannot be determined."""


def _nd_fix(name: str, shape: tuple[int, ...]) -> str:
    """The ``rules=`` entries that settle a tensor of more than two axes."""
    pattern = re.escape(name)
    fold = "x".join(map(str, shape[2:]))
    work = f"({shape[0]}, {shape[1] * (torch.Size(shape[2:]).numel())})"
    stack = (
        f", {{{pattern!r}: ('matrix', 'experts:row')}} for a stack of {shape[0]} matrices {shape[1:]}"
        if len(shape) == 3
        else ""
    )
    return (
        f"Pass an explicit rule, e.g. assign_roles(model, rules={{{pattern!r}: ('matrix', 'flatten:{fold}')}}) "
        f"for one {work} work matrix (rows = the first axis; a spectral step on it, as for a convolution)"
        f"{stack}, or {{{pattern!r}: 'vector'}} for an element-wise rule"
    )
