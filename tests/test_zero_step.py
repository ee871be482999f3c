"""A step with all-zero gradients at lr 0 (what torchtitan's checkpointing runs to create
optimizer state) leaves every weight unchanged and every state finite, for every rule,
centring, layout and update size."""

import itertools

import pytest
import torch

from equiopt.optim import EquivariantOptimizer

SHAPES = {"row": (64, 16), "col": (16, 64), "heads:8": (32, 16), "experts:row": (4, 24, 8)}


@pytest.mark.parametrize(
    "rule,center,scale",
    [
        (rule, center, scale)
        for rule, center, scale in itertools.product(
            ("spectral", "right", "left", "row", "hybrid", "sgd"), (False, True), ("nu", "rms")
        )
        if not (center and rule in ("spectral", "sgd"))
    ]
    + [("adamw", False, "nu")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_gradient_step_at_lr_zero_changes_nothing(rule, center, scale, dtype):
    gen = torch.Generator().manual_seed(0)
    layouts = list(SHAPES) if rule != "adamw" else ["row"]
    params = [torch.nn.Parameter(torch.randn(SHAPES[s], generator=gen).to(dtype)) for s in layouts]
    before = [p.detach().clone() for p in params]
    group = {"params": params, "layouts": layouts, "rule": rule, "lr": 0.0, "weight_decay": 0.1}
    if rule not in ("adamw", "sgd"):
        group.update(center=center, scale=scale)
    opt = EquivariantOptimizer([group])
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, b, spec in zip(params, before, layouts):
        assert torch.equal(p.detach(), b), (rule, spec)
        for key, value in opt.state[p].items():
            assert torch.isfinite(value).all(), (rule, spec, key)
    assert opt.nonfinite_steps == 0
    # and a real step afterwards moves the weights by finite amounts
    for g in opt.param_groups:
        g["lr"] = 0.01
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
    opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p.detach(), b) for p, b in zip(params, before))
