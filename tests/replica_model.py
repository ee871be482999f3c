"""Models for ``equiopt roles --check-replicas`` under torchrun (tests/test_replicas.py): a
Qwen3 after one backward, its gradients all-reduced as DDP leaves them (``replicated``), or
with tensor parallelism on its attention projections (``tensor_parallel``)."""

import torch
import torch.distributed as dist


def _model_and_batch():
    from equiopt.opcount import qwen3_structure

    torch.manual_seed(0)
    model = qwen3_structure(2, 32)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, ids


def replicated():
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model, ids = _model_and_batch()
    model(input_ids=ids, labels=ids).loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    return model


def tensor_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size() if dist.is_initialized() else 2,))
    model, ids = _model_and_batch()
    plan = {
        "q_proj": ColwiseParallel(),
        "k_proj": ColwiseParallel(),
        "v_proj": ColwiseParallel(),
        "o_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh, plan)
    model(input_ids=ids, labels=ids).loss.backward()
    return model
