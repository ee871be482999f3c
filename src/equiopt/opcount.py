"""Counting the ATen operators an optimizer step dispatches (``python -m equiopt.bench --ops``).

On an accelerator every dispatched operator is at least one kernel launch (a few
microseconds each, eager), so the number of operators a step dispatches bounds its time
from below however small the parameters are. :func:`count_ops` counts them with a
``TorchDispatchMode`` around one step taken after warm-up steps (so state creation is not
counted); :func:`qwen3_structure` builds a model with Qwen3-0.6B's structure (28 layers,
16 query and 8 key-value heads, tied embedding, 310 parameters) at tiny widths, since the
count depends on the structure only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "VIEW_OPS",
    "PLACEMENTS",
    "OpCounter",
    "count_ops",
    "qwen3_structure",
    "ops_table",
    "placed_step_ops",
    "placed_ops_table",
]


#: ATen operators that return a view of their input (no kernel runs).
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "slice",
        "select",
        "narrow",
        "expand",
        "detach",
        "alias",
        "as_strided",
        "unbind",
        "split",
        "split_with_sizes",
        "transpose",
        "t",
        "permute",
        "unsqueeze",
        "squeeze",
        "diagonal",
        "unflatten",
        "movedim",
        "view_as_real",
        "lift_fresh",
    }
)


class OpCounter(TorchDispatchMode):
    """Counts every ATen operator dispatched while active, by name (``counts``) and in all (``total``)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def launches(self) -> int:
        """The operators that run a kernel: all but those that only make a view of their
        input's memory (:data:`VIEW_OPS`, free on an accelerator but for the dispatch)."""
        return self.total - sum(self.counts[name] for name in VIEW_OPS)


def count_ops(step: Callable[[], object], warmup: int = 2) -> OpCounter:
    """The operators of one call of ``step`` after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    with OpCounter() as counter:
        step()
    return counter


def qwen3_structure(layers: int = 28, width: int = 64, seed: int = 0) -> torch.nn.Module:
    """A transformers ``Qwen3ForCausalLM`` with Qwen3-0.6B's structure at a tiny width
    (16 query and 8 key-value heads of ``width // 8`` each, tied embedding, vocabulary 256)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    head = max(width // 8, 2)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=width,
        intermediate_size=3 * width,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=head,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    return Qwen3ForCausalLM(config)


def _random_grads(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def ops_per_step(optimizer_of: Callable[[torch.nn.Module], torch.optim.Optimizer], layers: int = 28) -> OpCounter:
    """Operators of one step of ``optimizer_of(model)`` on :func:`qwen3_structure` with random gradients."""
    model = qwen3_structure(layers)
    _random_grads(model)
    opt = optimizer_of(model)
    return count_ops(opt.step)


def _torch_muon(model: torch.nn.Module) -> torch.optim.Optimizer:
    """``torch.optim.Muon`` on the matrices, torch's foreach AdamW on the rest, stepped together."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    muon = torch.optim.Muon(matrices, lr=0.02)  # type: ignore[attr-defined]
    adamw = torch.optim.AdamW(rest, lr=1e-3, foreach=True)

    class Both:
        def step(self):
            muon.step()
            adamw.step()

    return Both()  # type: ignore[return-value]


def ops_table(recipes: list[str], layers: tuple[int, ...] = (28, 56)) -> list[tuple[str, dict[int, OpCounter]]]:
    """``(name, {layers: counter})`` for torch's foreach AdamW, torch's Muon (where torch has
    it) and each recipe, on the Qwen3-0.6B structure at each depth."""
    from .roles import build_optimizer

    rows: list[tuple[str, Callable]] = [
        ("torch.optim.AdamW(foreach=True)", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True))
    ]
    if hasattr(torch.optim, "Muon"):
        rows.append(("torch.optim.Muon + AdamW", _torch_muon))
    for name in recipes:
        rows.append((name, lambda m, name=name: build_optimizer(m, name, compile=False)[0]))
    return [(label, {n: ops_per_step(make, n) for n in layers}) for label, make in rows]


#: Placements :func:`placed_step_ops` counts, with the processes each takes.
PLACEMENTS = {"fsdp2": 2, "ddp": 2, "hsdp": 4}


def _placed(model: torch.nn.Module, placement: str) -> torch.nn.Module:
    """``model`` placed over the default process group: ``fsdp2`` (blocks and root
    ``fully_shard``-ed over all ranks), ``hsdp`` (the same on a 2-D mesh: replicas of 2-rank
    shards), ``ddp`` (replicated; the optimizer divides its maps among the replicas)."""
    import torch.distributed as dist

    from .train.parallel import apply_fsdp2, fsdp2_api, transformer_blocks

    world = dist.get_world_size()
    if placement == "fsdp2":
        return apply_fsdp2(model, torch.device("cpu"), world)
    if placement == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = fsdp2_api()[0]
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if placement == "ddp":
        return model
    raise ValueError(f"unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}")


def placed_step_ops(recipe: str, layers: int = 28, placement: str = "fsdp2") -> OpCounter:
    """Operators of one step of ``recipe`` on this rank, with :func:`qwen3_structure` placed
    by ``placement`` (:data:`PLACEMENTS`) over the default process group: under FSDP2 and
    HSDP every parameter is a DTensor, under DDP every one is replicated and the optimizer
    divides its matrix maps among the ranks (``divide_work=True``)."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from .distributed.placements import is_dtensor
    from .roles import build_optimizer

    model = _placed(qwen3_structure(layers), placement)
    gen = torch.Generator().manual_seed(0)
    grads = {name: torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}
    divide = True if placement == "ddp" else None
    opt = build_optimizer(model, recipe, compile=False, divide_work=divide)[0]
    if placement == "ddp" and not opt.divides_work:
        raise RuntimeError(f"{recipe}: the optimizer divides no work over {dist.get_world_size()} ranks")

    def give():  # the gradients, outside the counted step
        for name, p in model.named_parameters():
            g = grads[name]
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if is_dtensor(p) else g.clone()  # type: ignore[attr-defined]

    for _ in range(2):  # the state exists before the counted step
        give()
        opt.step()
    give()
    with OpCounter() as counter:
        opt.step()
    return counter


def _placed_rank(
    rank: int, world: int, directory: str, recipes: list[str], layers: tuple[int, ...], placement: str
) -> None:
    import json
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world)
    try:
        found = {}
        for r in recipes:
            for n in layers:
                counter = placed_step_ops(r, n, placement)
                found[f"{r}@{n}"] = (counter.total, counter.launches)
        if rank == 0:
            with open(f"{directory}/ops.json", "w") as f:
                json.dump(found, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def placed_ops_table(
    recipes: list[str], layers: tuple[int, ...] = (28, 56), placement: str = "fsdp2"
) -> dict[str, dict[int, tuple[int, int]]]:
    """``{recipe: {layers: (operators, kernel launches)}}`` of one step on rank 0 of the
    gloo processes ``placement`` takes (:data:`PLACEMENTS`; spawned here, a file
    rendezvous), the Qwen3-0.6B structure placed by :func:`placed_step_ops`."""
    import json
    import tempfile

    world = PLACEMENTS[placement]
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.spawn(
            _placed_rank, args=(world, directory, recipes, layers, placement), nprocs=world, join=True
        )
        with open(f"{directory}/ops.json") as f:
            found = json.load(f)
    return {r: {n: tuple(found[f"{r}@{n}"]) for n in layers} for r in recipes}  # type: ignore[misc]
