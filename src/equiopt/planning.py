"""``equiopt plan``: what a recipe's optimizer step sends and computes on a device mesh of
any size, decided before launch, on one CPU.

The model is built on the meta device and sharded over a fake process group of the
mesh's size (torch's ``fake`` backend, as used for memory estimation) with torch's own
parallel functions: tensor parallelism as torchtitan applies it to Llama
(``ColwiseParallel`` on q/k/v/gate/up and the LM head, ``RowwiseParallel`` on o/down and
the embedding, ``SequenceParallel`` norms), ``fully_shard`` on ``dp_shard`` (HSDP with
``dp_replicate``). Expert parallelism is laid out as torchtitan lays it out: ``ep``
adds no ranks but is carved out of ``dp_shard x tp`` (the world is
``dp_replicate x dp_shard x tp``); expert stacks (3-D parameters of MoE experts) live on
a second mesh over the same ranks, ``(dp_replicate, efsdp, ep)`` with
``efsdp = dp_shard x tp / ep``: ``Shard(0)`` on ``ep`` and FSDP on ``efsdp`` (whole
experts, or ``Shard(1)`` inside them when the experts are fewer than ``efsdp x ep``).
Then the optimizer is built as on a real mesh, and
:func:`equiopt.optim.planner.plan_step` gives its own decisions per parameter and rank.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import torch

__all__ = ["MESH_DIMS", "parse_mesh", "world_size", "fake_world", "shard_model", "plan_model", "format_plan"]

MESH_DIMS = ("dp_replicate", "dp_shard", "ep", "tp")
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "wq", "wk", "wv", "w1", "w3")
ROWWISE = ("o_proj", "down_proj", "wo", "w2")
EMBEDDINGS = ("embed_tokens", "tok_embeddings")
HEADS = ("lm_head", "output")
ADAMW_BYTES_PER_ELEMENT = 28  # fused AdamW reads weight, gradient and two moments, writes weight and moments (fp32)


def parse_mesh(spec: str) -> dict[str, int]:
    """``"dp_shard=64,tp=8"`` -> ``{"dp_shard": 64, "tp": 8}`` in mesh order (:data:`MESH_DIMS`)."""
    sizes = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in MESH_DIMS or not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"--mesh {spec!r}: expected NAME=SIZE items with NAME in {', '.join(MESH_DIMS)} "
                f"and SIZE >= 1, got {item!r}"
            )
        sizes[name] = int(value)
    if not sizes:
        raise ValueError(f"--mesh {spec!r}: no mesh dimension given")
    _borrowed(sizes)
    return {name: sizes[name] for name in MESH_DIMS if name in sizes}


def fake_world(world: int) -> None:
    """A fake process group of ``world`` ranks, this process rank 0 (torch's ``fake`` backend:
    collectives complete at once and move nothing); refused where a group exists."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a simulated mesh runs on its own fake process group; a process group is already initialised"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _tensor_parallel(model: torch.nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and leaf in EMBEDDINGS:
            plan[name] = RowwiseParallel(input_layouts=Replicate())
        elif isinstance(module, torch.nn.Linear) and (leaf in COLWISE or leaf in HEADS):
            plan[name] = ColwiseParallel()
        elif isinstance(module, torch.nn.Linear) and leaf in ROWWISE:
            plan[name] = RowwiseParallel()
        elif (
            "norm" in type(module).__name__.lower()
            and getattr(module, "weight", None) is not None
            and module.weight.ndim == 1
            and "q_norm" not in leaf
            and "k_norm" not in leaf
        ):
            plan[name] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)


def _expert_stacks(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.ndim == 3 and "expert" in n]


def _borrowed(sizes: dict[str, int]) -> int:
    """The ranks ``ep`` is carved out of, ``dp_shard x tp``; ``ep`` must divide them."""
    inner = sizes.get("dp_shard", 1) * sizes.get("tp", 1)
    if inner % sizes.get("ep", 1):
        raise ValueError(
            f"--mesh: ep={sizes['ep']} must divide dp_shard x tp = {inner} (expert parallelism borrows those ranks)"
        )
    return inner


def world_size(sizes: dict[str, int]) -> int:
    """Ranks of a mesh of ``sizes``: ``ep`` is carved out of ``dp_shard x tp`` and adds none."""
    return math.prod(v for k, v in sizes.items() if k != "ep")


def _expert_mesh(sizes: dict[str, int]):
    """torchtitan's mesh of expert stacks over the same ranks: ``(dp_replicate, efsdp, ep)``."""
    from torch.distributed.device_mesh import init_device_mesh

    ep = sizes["ep"]
    dims = {"dp_replicate": sizes.get("dp_replicate", 1), "efsdp": _borrowed(sizes) // ep, "ep": ep}
    dims = {k: v for k, v in dims.items() if v > 1 or k != "dp_replicate"}
    return init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))


def _place_experts(model: torch.nn.Module, mesh, names: list[str]) -> set:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placed = set()
    sizes = dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))
    for name in names:
        *path, leaf = name.split(".")
        owner = model.get_submodule(".".join(path))
        p = getattr(owner, leaf)
        whole = p.shape[0] % (sizes["efsdp"] * sizes["ep"]) == 0
        by_dim = {"dp_replicate": Replicate(), "efsdp": Shard(0) if whole else Shard(1), "ep": Shard(0)}
        placements = [by_dim[d] for d in mesh.mesh_dim_names]
        q = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements), requires_grad=p.requires_grad)
        setattr(owner, leaf, q)
        placed.add(q)
    return placed


def shard_model(model: torch.nn.Module, sizes: dict[str, int]) -> torch.nn.Module:
    """Shard ``model`` in place over a mesh of ``sizes`` (see the module); needs an
    initialised process group of :func:`world_size` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from .train.parallel import fsdp2_api, transformer_blocks

    dense = {k: v for k, v in sizes.items() if k != "ep"}
    experts = _expert_stacks(model) if sizes.get("ep", 1) > 1 else []
    ignored = _place_experts(model, _expert_mesh(sizes), experts) if experts else set()
    if not dense:  # "ep=1" alone: one rank
        dense = {"dp_shard": 1}
    mesh = init_device_mesh("cpu", tuple(dense.values()), mesh_dim_names=tuple(dense))
    if sizes.get("tp", 1) > 1:
        _tensor_parallel(model, mesh["tp"])
    dp = [d for d in ("dp_replicate", "dp_shard") if d in sizes]
    if dp:
        fully_shard = fsdp2_api()[0]
        dp_mesh = mesh[tuple(dp)] if len(dp) > 1 else mesh[dp[0]]
        kwargs: dict[str, Any] = {"mesh": dp_mesh}
        if ignored:
            kwargs["ignored_params"] = ignored
        for block in transformer_blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model


def _load(spec: str) -> torch.nn.Module:
    """A paper architecture (``family[:size]``, default size ``paper``) or a transformers
    config name or path, built on the meta device."""
    from . import models

    family, _, size = spec.partition(":")
    if family in models.FAMILIES:
        return models.build(family, size or "paper", device="meta")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(spec)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def plan_model(
    spec: str, recipe: str, sizes: dict[str, int], ranks: list[int] | None = None, cost_model: str = "nccl-h100"
) -> dict[str, Any]:
    """The plan of ``recipe`` on model ``spec`` over a mesh of ``sizes``, as the JSON document
    ``equiopt plan --json`` writes (keys ``mesh``, ``world``, ``parameters``, ``totals``)."""
    import torch.distributed as dist

    import equiopt

    from .optim.planner import plan_step

    world = world_size(sizes)
    start = time.perf_counter()
    fake_world(world)
    try:
        model = _load(spec)
        roles = {row.name: row.role for row in equiopt.assign_roles(model)}
        shard_model(model, sizes)
        optimizer, _ = equiopt.build_optimizer(model, recipe, cost_model=cost_model)
        step = plan_step(optimizer, ranks)
    finally:
        dist.destroy_process_group()
    totals = step.totals()
    busiest = step.per_rank[totals["busiest_rank"]]
    params = [dict(p._asdict(), role=roles.get(p.name, "?")) for p in step.parameters]
    totals.update(
        {
            "busiest_rank_flops": busiest[1],
            "finite_flag_bytes_per_rank_max": step.flag_bytes_per_rank,
            "adamw_state_traffic_bytes_per_rank": busiest[3] * ADAMW_BYTES_PER_ELEMENT,
            "ranks_planned": len(step.per_rank),
            "seconds": round(time.perf_counter() - start, 1),
        }
    )
    for p in params:
        p["shape"] = list(p["shape"])
        p["axes"] = list(p["axes"])
    return {
        "model": spec,
        "recipe": recipe,
        "cost_model": cost_model,
        "mesh": sizes,
        "world": world,
        "parameters": params,
        "totals": totals,
    }


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def format_plan(doc: dict[str, Any]) -> str:
    """The plan as a table, then totals and the busiest rank."""
    head = ("name", "shape", "placements", "role", "rule", "plan", "axes", "step", "MiB sent", "GFLOP", "state MiB")
    rows = [head]
    for p in doc["parameters"]:
        rows.append(
            (
                p["name"],
                "x".join(map(str, p["shape"])),
                p["placements"] or "-",
                p["role"],
                p["rule"],
                p["plan"],
                ",".join(p["axes"]) or "-",
                p["step"],
                _mb(p["bytes_sent_per_rank"]),
                f"{p['flops_per_rank'] / 1e9:.3f}",
                _mb(p["state_bytes_per_rank"]),
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    t = doc["totals"]
    mesh = ", ".join(f"{k}={v}" for k, v in doc["mesh"].items())
    counts: dict[str, int] = {}
    for p in doc["parameters"]:
        counts[p["plan"]] = counts.get(p["plan"], 0) + 1
    buckets = {p["step"] for p in doc["parameters"] if p["step"] != "per-parameter"}
    alone = sum(p["step"] == "per-parameter" for p in doc["parameters"])
    lines += [
        "",
        f"{doc['model']} with {doc['recipe']} on {mesh} ({doc['world']} ranks, {t['ranks_planned']} planned, "
        f"cost model {doc['cost_model']}, "
        f"{t['seconds']} s): " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
        f"the step: {sum(b.startswith('bucket') for b in buckets)} matrix buckets and "
        f"{sum(b.startswith('adamw') for b in buckets)} AdamW parts (equiopt.optim.bucket_plan.plan_buckets), "
        f"{alone} parameters on the per-parameter path",
        f"busiest rank {t['busiest_rank']}: sends {_mb(t['bytes_sent_per_rank_max'])} MiB per step "
        f"(finite flags {t['finite_flag_bytes_per_rank_max']} B), {t['busiest_rank_flops'] / 1e9:.2f} GFLOP; "
        f"most FLOPs on a rank {t['flops_per_rank_max'] / 1e9:.2f} GFLOP; "
        f"state {_mb(t['state_bytes_per_rank_max'])} MiB",
        f"one fused AdamW step on that state moves about {_mb(t['adamw_state_traffic_bytes_per_rank'])} MiB through "
        f"memory ({ADAMW_BYTES_PER_ELEMENT} B per parameter element): the step sends "
        f"{t['bytes_sent_per_rank_max'] / max(t['adamw_state_traffic_bytes_per_rank'], 1):.3f} of that",
    ]
    return "\n".join(lines)


def write_json(doc: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
