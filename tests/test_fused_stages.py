"""The vocabulary maps' first stage (momentum, row statistics, centring, row scaling, guard,
update add) compiled into fused kernels: what CUDA steps by default (``compile=None``), here
through Inductor's CPU backend. Compiled equals eager, and the stage is fused: the compiled
core runs far fewer kernels than the eager stage dispatches operators."""

import pytest
import torch
from torch._inductor import metrics

from equiopt.opcount import OpCounter
from equiopt.optim import EquivariantOptimizer

# row-norm, centred row-norm (the LM head's), and the hybrid whose row stage feeds the Gram
STAGES = [
    {"rule": "row"},
    {"rule": "row", "center": True},
    {"rule": "hybrid", "order": "row_then_right", "gram_dtype": "float32"},
    {"rule": "hybrid", "order": "row_then_right", "center": True, "gram_dtype": "bfloat16x6"},
]


def _steps(settings, compile_setting, grads, counter=None):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(grads[0].shape, generator=g))
    opt = EquivariantOptimizer(
        [{"params": [p], **settings}], lr=0.01, weight_decay=0.1, nesterov=True, compile=compile_setting
    )
    for i, grad in enumerate(grads):
        p.grad = grad.clone()
        if counter is not None and i == len(grads) - 1:
            with counter:
                opt.step()
        else:
            opt.step()
    return p.detach().clone(), opt


@pytest.mark.parametrize("settings", STAGES, ids=["row", "row-centred", "hybrid", "hybrid-centred-bf16x6"])
def test_compiled_vocabulary_stage_equals_eager_and_is_fused(settings):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    shape = (1024, 32)  # a vocabulary matrix, downsized
    grads = [torch.randn(shape, generator=g) for _ in range(4)]
    grads[2][5, 3] = float("nan")  # a skipped step between healthy ones
    eager_ops = OpCounter()
    eager, eager_opt = _steps(settings, False, grads, eager_ops)
    metrics.reset()
    compiled, opt = _steps(settings, True, grads)
    assert not opt._compile_failed and opt.nonfinite_steps == eager_opt.nonfinite_steps == 1
    assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-6)
    if settings["rule"] == "row":
        # the stage in a few loops over the matrix, where eager dispatches one operator per stage
        assert 0 < metrics.generated_kernel_count <= eager_ops.total // 3
