"""Matrix products that dispatch one operator each.

``a @ b`` on 3-D tensors goes through ``torch.matmul``, which dispatches an expand, a
reshape, the batched product and a view: four operators (each a few microseconds of host
time, eager) for one kernel. The maps and oracles take many small products per step, so
they call :func:`mm`, which goes to ``torch.bmm`` / ``torch.mm`` directly where the
shapes allow and to ``@`` otherwise (same result either way).
"""

from __future__ import annotations

import torch

__all__ = ["mm"]


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``: ``torch.bmm`` for 3-D operands of one batch size, ``torch.mm`` for 2-D ones."""
    if a.ndim == 3 and b.ndim == 3 and a.shape[0] == b.shape[0]:
        return torch.bmm(a, b)
    if a.ndim == 2 and b.ndim == 2:
        return torch.mm(a, b)
    return a @ b
