"""Helpers of the tests that compare a sharded optimizer step with one process."""

import torch


def global_grads(model, step, seed):
    """A global gradient for every parameter, equal on every rank (seeded by ``seed + step``);
    the embedding's every third row is zero (tokens absent from the batch)."""
    gen = torch.Generator().manual_seed(seed + step)
    out = {}
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if name.endswith("embed_tokens.weight"):
            g[::3] = 0
        out[name] = g
    return out


def give_grads(grads, *models):
    """``grads`` as the gradients of every model: plain tensors as they are, each DTensor's
    distributed like its parameter by torch's ``distribute_tensor``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for model in models:
        for name, p in model.named_parameters():
            g = grads[name].clone()
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def in_quotient(t, opt, param):
    """``t`` with every work matrix centred when ``param``'s group has a centred map: such a
    map sees only ``Pi M``, and a step that maps the whole matrix locally stores ``Pi M``."""
    for group in opt.param_groups:
        for j, q in enumerate(group["params"]):
            if q is param and group["center"] and group["rule"] != "spectral":
                t = t.clone()
                for w in group["layouts"][j].to_work_list(t):
                    w.sub_(w.mean(dim=-2, keepdim=True))
    return t
