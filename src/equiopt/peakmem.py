"""The peak memory a call allocates beyond what it started with, on any device.

On CUDA this is the caching allocator's own statistic (``torch.cuda.max_memory_allocated``).
Elsewhere (the CPU) torch keeps no such statistic, but its profiler records every
allocation and free with its size (``profile_memory=True``): the running sum of those
events, in order, peaks where the call held the most. Tensors that existed before the call
count as zero. Freeing one of them lowers the sum where the profiler knows the block's size
and leaves it where it does not (a block allocated while no profiler recorded memory), so
the CPU figure is at least CUDA's for the same call and at most the peak of its own
allocations.

``python -m equiopt.bench --stack`` reports it as "peak extra MiB" of an optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["peak_extra_bytes"]


def peak_extra_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Bytes that ``fn()`` holds at its peak beyond what was allocated when it began.

    Args:
        fn: the call to measure (run once).
        device: where its tensors live; CUDA reads the allocator's statistics, any other
            device the profiler's allocation events.

    Returns:
        The peak of the memory allocated during the call minus the memory allocated before
        it, in bytes (0 if it allocated nothing).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak
