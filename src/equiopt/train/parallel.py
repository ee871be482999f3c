"""Data-parallel strategies of the training loop, in one place: DDP or FSDP2.

``ddp``: ``DistributedDataParallel`` around the model; every rank holds every weight.
``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each transformer block and on the
root, so each rank holds a dim-0 slice (``Shard(0)``) of every parameter as a DTensor,
with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on CUDA.
Blocks are the classes a Hugging Face model names in ``_no_split_modules`` (its decoder
layers), else the members of the model's longest ``nn.ModuleList`` of one class.

With one process neither wraps anything: the model trains as is. The optimizer is built
after wrapping, from the model itself (its parameter names and roles are unchanged).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["STRATEGIES", "fsdp2_api", "transformer_blocks", "apply_fsdp2", "wrap_model", "gradient_sync"]

STRATEGIES = ("ddp", "fsdp2")


def fsdp2_api():
    """``(fully_shard, MixedPrecisionPolicy, FSDPModule)`` from where this torch keeps them."""
    try:  # torch >= 2.6
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        except ImportError as err:  # pragma: no cover - depends on the torch build
            raise RuntimeError(
                f"strategy 'fsdp2' needs torch.distributed.fsdp.fully_shard (torch >= 2.6), "
                f"which torch {torch.__version__} does not have"
            ) from err
    return fully_shard, MixedPrecisionPolicy, FSDPModule


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one (decoder layers), outermost first; may be empty."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[nn.Module] = []
    if names:
        for module in model.modules():
            if (
                module is not model
                and type(module).__name__ in names
                and not any(module is b or _contains(b, module) for b in blocks)
            ):
                blocks.append(module)
    if blocks:
        return blocks
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and any(True for _ in module[0].parameters()):
                best = list(module)
    return best


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def apply_fsdp2(
    model: nn.Module, device: torch.device, world_size: int, mixed_precision: bool | None = None
) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard`` (blocks, then the root) over a 1-D mesh of all ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, MixedPrecisionPolicy, _ = fsdp2_api()
    if mixed_precision is None:
        mixed_precision = device.type == "cuda"
    mesh = init_device_mesh(device.type, (world_size,))
    kwargs = {"mesh": mesh}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def wrap_model(model: nn.Module, strategy: str, device: torch.device, world_size: int) -> nn.Module:
    """The module to run forward and backward on: ``model`` itself, DDP around it, or it sharded (in place)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if world_size <= 1:
        return model
    if strategy == "fsdp2":
        return apply_fsdp2(model, device, world_size)
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


@contextmanager
def gradient_sync(forward_model: nn.Module, sync: bool) -> Iterator[None]:
    """Skip the gradient reduction of a micro-batch that is not the last of its step (DDP and FSDP2)."""
    if sync:
        yield
        return
    if hasattr(forward_model, "no_sync"):  # DDP
        with forward_model.no_sync():
            yield
        return
    target = getattr(forward_model, "_orig_mod", forward_model)  # through torch.compile
    if hasattr(target, "set_requires_gradient_sync"):  # FSDP2
        target.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            target.set_requires_gradient_sync(True)
        return
    yield
