"""Models for the replica check (tests/test_replicas.py), in-process and for ``equiopt roles
--check-replicas`` under torchrun: a Qwen3 after one backward, its gradients all-reduced as DDP
leaves them (``replicated``), or with tensor parallelism on its attention projections
(``tensor_parallel``)."""

import torch
import torch.distributed as dist


def model_and_batch():
    """The same small Qwen3 and token batch on every rank."""
    from equiopt.opcount import qwen3_structure

    torch.manual_seed(0)
    model = qwen3_structure(2, 32)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, ids


def backward(model, ids, all_reduce: bool = False):
    """One backward; with ``all_reduce`` the gradients summed over ranks, as DDP leaves them equal."""
    model(input_ids=ids, labels=ids).loss.backward()
    if all_reduce:
        for p in model.parameters():
            dist.all_reduce(p.grad)


def shard_attention(model):
    """torch's tensor parallelism on every attention's projections over all ranks
    (``ColwiseParallel`` q/k/v, ``RowwiseParallel`` o): q_norm / k_norm stay plain and replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size() if dist.is_initialized() else 2,))
    plan = {
        "q_proj": ColwiseParallel(),
        "k_proj": ColwiseParallel(),
        "v_proj": ColwiseParallel(),
        "o_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh, plan)
    return model


def replicated():
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model, ids = model_and_batch()
    backward(model, ids, all_reduce=True)
    return model


def tensor_parallel():
    model, ids = model_and_batch()
    shard_attention(model)
    backward(model, ids)
    return model
