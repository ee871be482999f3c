"""On a CUDA device: the bucketed step equals the CPU one, and a CUDA-graph replay
(GraphedStep) equals the eager step under a learning-rate schedule. Skipped without CUDA."""

import pytest
import torch

from equiopt.optim import EquivariantOptimizer, GraphedStep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GROUPS = [
    {"rule": "spectral", "layout": "heads:16", "polar_dtype": torch.float32, "weight_decay": 0.1},
    # route "gram" on both devices: under "auto" CUDA takes the direct route where it costs less and the
    # CPU the Gram route (docs/science.md, "Routes"), which agree to Polar Express's accuracy, not to 1e-4;
    # that agreement is tests/test_route.py's
    {"rule": "hybrid", "center": True, "route": "gram"},
    {"rule": "row", "center": True},
    {"rule": "right", "route": "gram"},
    {"rule": "adamw", "weight_decay": 0.01},
]
SHAPES = [[(64, 32)] * 3, [(96, 16)] * 2, [(128, 16)], [(80, 16)] * 2, [(32,), (16,), (4, 4)]]


def _model(device):
    g = torch.Generator().manual_seed(0)
    return [[torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes] for shapes in SHAPES]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [[torch.randn(p.shape, generator=g).to(p.device) for p in group] for group in params]


def _opt(params, lr=0.01):
    return EquivariantOptimizer(
        [{"params": ps, **settings} for ps, settings in zip(params, GROUPS)], lr=lr, compile=False
    )


def _flat(params):
    return [p for group in params for p in group]


def test_cuda_step_equals_cpu_step():
    cpu, gpu = _model("cpu"), _model("cuda")
    a, b = _opt(cpu), _opt(gpu)
    for step in range(4):
        for params in (cpu, gpu):
            for p, g in zip(_flat(params), [g for gs in _grads(params, step) for g in gs]):
                p.grad = g.to(p.device)
        a.step()
        b.step()
    for x, y in zip(_flat(cpu), _flat(gpu)):
        torch.testing.assert_close(x, y.cpu(), rtol=1e-4, atol=1e-5)


def _graphed_against_eager(lr_of):
    eager, graphed = _model("cuda"), _model("cuda")
    a, b = _opt(eager, lr_of()), _opt(graphed, lr_of())
    sa = torch.optim.lr_scheduler.LambdaLR(a, lambda t: 1.0 / (1 + t))
    sb = torch.optim.lr_scheduler.LambdaLR(b, lambda t: 1.0 / (1 + t))
    step = GraphedStep(b, warmup=2)
    grads = [p.grad for p in _flat(graphed)]
    for t in range(7):
        fresh = [g for gs in _grads(eager, t) for g in gs]
        for p, g in zip(_flat(eager), fresh):
            p.grad = g.clone()
        for k, (p, g) in enumerate(zip(_flat(graphed), fresh)):
            if grads[k] is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)  # static gradient buffers, as zero_grad(set_to_none=False) keeps them
        grads = [p.grad for p in _flat(graphed)]
        a.step()
        step()
        sa.step()
        sb.step()
    assert step.graph is not None
    for x, y in zip(_flat(eager), _flat(graphed)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_graphed_step_equals_eager_under_a_schedule():
    _graphed_against_eager(lambda: 0.01)


def test_graphed_step_with_a_tensor_lr_equals_eager_under_a_schedule():
    # torch's schedulers fill a tensor lr in place: each replay reads the value it holds then
    _graphed_against_eager(lambda: torch.tensor(0.01, device="cuda"))


def test_graphed_step_refuses_replaced_gradients():
    params = _model("cuda")
    opt = _opt(params)
    step = GraphedStep(opt, warmup=1)
    for t in range(2):
        for p, g in zip(_flat(params), [g for gs in _grads(params, t) for g in gs]):
            p.grad = g
        if t == 0:
            step()
    step()  # the capture
    for p in _flat(params):
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="set_to_none=False"):
        step()
