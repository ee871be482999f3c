"""gram_dtype="bfloat16": float32-precise Grams from bfloat16 operands, the accuracy it keeps
against float64, equivariance at bfloat16 tolerances, and the optimizer setting."""

import pytest
import torch

from equiopt import maps
from equiopt.bench import _tall
from equiopt.diagnostics.equivariance import check_equivariance
from equiopt.optim import EquivariantOptimizer


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def test_low_product_keeps_float32_precision_where_one_bfloat16_product_does_not():
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(3, 2048, 64, generator=g) * torch.logspace(0, -2, 64)).to(torch.bfloat16)
    exact = a.double().mT @ a.double()
    assert _rel(maps.low_product(a.mT, a), exact) < 2e-5
    assert _rel((a.mT @ a).float(), exact) > 5e-4  # the rounding the residual removes


def test_low_times_splits_the_factor():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=g).to(torch.bfloat16)
    r = torch.randn(32, 32, generator=g)
    exact = x.double() @ r.double()
    # each product is rounded to bfloat16 once (a relative 2^-9 per entry), the factor is not
    assert _rel(maps.low_times(x, r), exact) < 4e-3
    assert _rel(maps.low_times(x.mT, r.mT, right=False), exact.mT) < 4e-3


# vocabulary-, MLP- and router-shaped work matrices (downsized), conditions up to 100
SHAPES = [(4096, 128), (768, 256), (2048, 32)]


@pytest.mark.parametrize("m, n", SHAPES)
@pytest.mark.parametrize("cond", [1e1, 1e2])
def test_bfloat16_grams_stay_within_two_percent_of_float64(m, n, cond):
    D = _tall(m, n, cond, 1e-2, torch.Generator().manual_seed(int(cond) + m))
    for fn in (maps.right_spectral, lambda d, **k: maps.hybrid(d, scale="rms", **k)):
        exact = fn(D)
        low = fn(D.float(), gram_dtype="bfloat16")
        assert low.dtype == torch.float32
        assert _rel(low, exact) < 0.02
    # the router form: a wide, centred left map
    W = D.mT.contiguous()
    exact = maps.left_spectral(W, center=True)
    assert _rel(maps.left_spectral(W.float(), center=True, gram_dtype="bfloat16"), exact) < 0.02


@pytest.mark.parametrize(
    "fn, group",
    [
        (lambda d, **k: maps.right_spectral(d, **k), "lpro"),
        (lambda d, **k: maps.hybrid(d, **k), "lpro"),
        (lambda d, **k: maps.left_spectral(d, center=True, **k), "router"),
    ],
)
def test_equivariance_holds_at_bfloat16_tolerance(fn, group):
    low = lambda d: fn(d, gram_dtype="bfloat16")
    assert check_equivariance(low, group, (2, 96, 24), dtype=torch.float32) < 3e-2
    D = torch.randn(96, 24, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(low(D), fn(D))  # the bfloat16 path ran


def test_optimizer_setting_steps_close_to_float32_and_skips_nonfinite():
    g = torch.Generator().manual_seed(0)
    W = torch.nn.Parameter(torch.randn(256, 32, generator=g))
    V = torch.nn.Parameter(W.detach().clone())
    ours = EquivariantOptimizer([{"params": [W], "rule": "hybrid", "lr": 0.01, "gram_dtype": "bf16"}])
    ref = EquivariantOptimizer([{"params": [V], "rule": "hybrid", "lr": 0.01}])
    assert ours.param_groups[0]["gram_dtype"] == "bfloat16" and ref.param_groups[0]["gram_dtype"] == "float32"
    start = W.detach().clone()
    for _ in range(3):
        grad = torch.randn(256, 32, generator=g)
        W.grad, V.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    assert not torch.equal(W, V) and _rel(W - start, V - start) < 0.02
    W.grad = torch.full_like(W, float("nan"))
    before = W.detach().clone()
    ours.step()
    assert torch.equal(W, before) and ours.nonfinite_steps == 1
    with pytest.raises(ValueError, match="field 'gram_dtype': expected one of float32, bfloat16"):
        EquivariantOptimizer([{"params": [W], "rule": "right", "gram_dtype": "float16"}])
