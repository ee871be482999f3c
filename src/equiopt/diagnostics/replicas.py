"""Replica check: parameters and gradients that should be equal on every rank, compared.

A tensor replicated across ranks (every parameter under DDP; a plain parameter beside
tensor-parallel layers; the ``Replicate`` mesh dimensions of a DTensor) must stay equal
on every rank, and so must its gradient, or the copies drift apart without a word. The
classic trap: torch's tensor parallelism on a Hugging Face Qwen3 (``ColwiseParallel`` on
``q_proj``/``k_proj``/``v_proj``) leaves ``q_norm``/``k_norm`` replicated while each rank's
gradient of them covers only its own heads. :func:`check_replicas` compares a checksum of
each such tensor across its process group (one ``all_gather`` of a few numbers per tensor
and group) and names the ones that differ.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

__all__ = ["check_replicas"]


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Three float64 numbers that agree for equal tensors: the sum, the sum of squares and a
    position-weighted sum (so a permutation of the entries shows too)."""
    x = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device).remainder_(97).add_(1)
    return torch.stack([x.sum(), (x * x).sum(), (x * weights).sum()])


def _replicas_of(t: torch.Tensor, group: Any) -> list[tuple[torch.Tensor, Any]]:
    """``(local tensor, process group)`` pairs over which ``t`` should be equal."""
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # pragma: no cover - torch < 2.4
        from torch.distributed._tensor import DTensor, Replicate  # type: ignore[no-redef]
    if isinstance(t, DTensor):
        local = t.to_local()
        return [
            (local, t.device_mesh.get_group(dim))
            for dim, placement in enumerate(t.placements)
            if isinstance(placement, Replicate) and t.device_mesh.size(dim) > 1
        ]
    return [(t, group)]


def check_replicas(model: nn.Module, group: Any = None, grads: bool = True) -> list[str]:
    """Names of the parameters (``"name"``) and gradients (``"name (grad)"``) that differ
    across the ranks that should hold them equal: plain parameters across ``group`` (default
    the whole world: DDP, or plain parameters beside tensor- or expert-parallel layers), a
    DTensor across each of its ``Replicate`` mesh dimensions. Every rank must call it (a
    collective); every rank gets the same list.

    Args:
        model: the model (or any module); every parameter is checked, and its gradient when
            ``grads`` and it has one.
        group: the process group of the plain parameters; None: the default group.
        grads: check the gradients too.

    Raises:
        ValueError: without an initialised ``torch.distributed`` process group.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("check_replicas compares ranks: initialise torch.distributed first (torchrun)")
    group = group if group is not None else dist.group.WORLD
    pending: dict[Any, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, p in model.named_parameters():
        tensors = [(name, p)] + ([(f"{name} (grad)", p.grad)] if grads and p.grad is not None else [])
        for label, t in tensors:
            for local, pg in _replicas_of(t, group):
                pending[pg].append((label, local))
    differ: list[str] = []
    for pg, items in pending.items():  # the same groups in the same order on every rank
        sums = torch.stack([_checksum(t) for _, t in items])
        gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(gathered, sums, group=pg)
        every = torch.stack(gathered)
        same = (every == every[0]).all(dim=2).all(dim=0).tolist()
        differ.extend(label for (label, _), ok in zip(items, same) if not ok)
    return sorted(set(differ), key=differ.index)
