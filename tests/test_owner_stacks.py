"""The owner exchange moves alike tasks as stacks (equiopt.optim.owners.stack_groups): the
groups it forms, and on 2 gloo ranks the same whole matrices and update blocks as the
exchange of each task alone, with the same bytes."""

import torch
import torch.distributed as dist

from equiopt.optim.owners import stack_groups, start_from_owners, start_to_owners

# Six tasks on two ranks: rows split in two (FSDP2's Shard(0)), one split by columns, one
# uneven split; two owners.
SHAPES = [(8, 4), (8, 4), (8, 4), (6, 4), (8, 4), (8, 4)]
OWNERS = [0, 1, 0, 0, 0, 1]


def _blocks(t):
    m, n = SHAPES[t]
    if t == 4:  # split by columns
        return [((0, m), (0, n // 2)), ((0, m), (n // 2, n))]
    if t == 3:  # uneven rows
        return [((0, 4), (0, n)), ((4, m), (0, n))]
    return [((0, m // 2), (0, n)), ((m // 2, m), (0, n))]


def test_groups_split_by_owner_places_and_the_callers_key_in_task_order():
    blocks = [_blocks(t) for t in range(len(SHAPES))]
    alike = ["a", "a", "a", "a", "a", "b"]
    assert stack_groups(blocks, OWNERS, None, alike) == [[0, 2], [1], [3], [4], [5]]
    assert stack_groups(blocks, OWNERS, None) == [[t] for t in range(6)]  # no key: every task alone
    sources = [(0, 1), (0, 1), (0,), (0, 1), (0, 1), (0, 1)]  # a different source set parts 0 and 2
    assert stack_groups(blocks, OWNERS, sources, alike) == [[0], [1], [2], [3], [4], [5]]


def _exchange(rank, world):
    sent = []
    all_to_all = dist.all_to_all_single

    def counting(out, inp, *args, **kwargs):
        sent.append(inp.numel())
        return all_to_all(out, inp, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        g = torch.Generator().manual_seed(0)
        whole = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
        blocks = [_blocks(t) for t in range(len(SHAPES))]
        mine = [w[tuple(slice(a, b) for a, b in blocks[t][rank])].clone() for t, w in enumerate(whole)]
        found = {}
        for name, groups in (
            ("alone", None),
            ("stacked", stack_groups(blocks, OWNERS, None, ["a"] * 5 + ["b"])),
        ):
            stacks = start_to_owners(mine, blocks, OWNERS, rank, None, async_op=False, groups=groups).wait()
            members = groups or [[t] for t in range(len(SHAPES))]
            arrived = {t: stacks[k][i] for k, stack in stacks.items() for i, t in enumerate(members[k])}
            updates = {k: 2.0 * stack + 1.0 for k, stack in stacks.items()}
            back = start_from_owners(updates, blocks, OWNERS, rank, None, like=mine[0], async_op=False, groups=groups)
            found[name] = (arrived, back.wait(), list(sent))
            sent.clear()
        return whole, mine, found
    finally:
        dist.all_to_all_single = all_to_all


def test_stacked_exchange_equals_each_task_alone(gloo):
    for rank, (whole, mine, found) in enumerate(gloo(_exchange, 2)):
        (alone, back_alone, bytes_alone), (stacked, back_stacked, bytes_stacked) = found["alone"], found["stacked"]
        assert sorted(stacked) == [t for t, o in enumerate(OWNERS) if o == rank] == sorted(alone)
        for t in stacked:
            assert torch.equal(stacked[t], whole[t]) and torch.equal(alone[t], whole[t])
        for t, block in enumerate(mine):
            assert torch.equal(back_stacked[t], 2.0 * block + 1.0)
            assert torch.equal(back_alone[t], 2.0 * block + 1.0)
        assert bytes_stacked == bytes_alone  # the same elements travel, in another order
