"""equiopt.peakmem: the peak memory a call holds beyond what it began with."""

import torch

from equiopt.peakmem import peak_extra_bytes

MIB = 2**20


def test_the_peak_is_what_the_call_holds_at_once():
    kept = []

    def call():
        a = torch.empty(MIB // 4)  # 1 MiB
        b = torch.empty(MIB)  # 4 MiB: 5 held
        del a
        c = torch.empty(MIB // 2)  # 2 MiB: 6 held, the peak
        kept.append(c)
        del b

    assert peak_extra_bytes(call) == 6 * MIB
    assert peak_extra_bytes(lambda: None) == 0


def test_memory_held_before_the_call_does_not_count():
    old = [torch.empty(MIB)]  # 4 MiB, allocated before

    def touch():
        old[0].add_(1.0)  # in place: nothing new
        torch.empty(MIB // 2)  # 2 MiB, freed at once

    assert peak_extra_bytes(touch) == 2 * MIB

    def free():
        old.clear()  # frees 4 MiB: the sum goes down, or stays where the profiler never sized the block
        torch.empty(MIB // 2)

    assert peak_extra_bytes(free) <= 2 * MIB
