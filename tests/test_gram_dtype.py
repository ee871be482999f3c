"""gram_dtype: float32-precise Grams from bfloat16 operands ("bfloat16"), float32's accuracy
from bfloat16 products of split operands ("bfloat16x6"), the accuracy each keeps against
float64, equivariance, the automatic choice, and the optimizer setting."""

import pytest
import torch

from equiopt import maps
from equiopt.bench import _tall
from equiopt.diagnostics.equivariance import check_equivariance
from equiopt.linalg import inv_sqrt
from equiopt.linalg import products as P
from equiopt.linalg.device_choices import decide_as
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
    assert ours.param_groups[0]["gram_dtype"] == "bfloat16" and ref.param_groups[0]["gram_dtype"] == "auto"
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
    with pytest.raises(ValueError, match="field 'gram_dtype': expected one of auto, float32, bfloat16, bfloat16x6"):
        EquivariantOptimizer([{"params": [W], "rule": "right", "gram_dtype": "float16"}])


# ---------------------------------------------------------------- bfloat16x6: split products


def test_split_parts_sum_to_the_float32_tensor_exactly():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, 48, generator=g) * torch.logspace(-30, 30, 48)  # every magnitude
    parts = P.split(x)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 64, 144)
    total = sum(P.part(parts, i).double() for i in range(P.SPLIT_PARTS))
    assert torch.equal(total, x.double())
    # the same parts compiled (a compiler that folded a bfloat16 round trip would lose parts 2 and 3)
    assert torch.equal(torch.compile(P.split, fullgraph=True)(x), parts)


def test_split_products_are_as_accurate_as_float32_ones():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(4, 96, 2000, generator=g) * torch.logspace(0, -3, 2000)
    b = torch.randn(4, 2000, 80, generator=g)
    exact = a.double() @ b.double()
    float32 = _rel(a @ b, exact)
    assert _rel(P.split_mm(a, b), exact) < 4 * float32
    assert _rel(P.split_mm(a[0], b[0]), exact[0]) < 4 * float32
    # two parts (three products) are not: the third part is what buys the accuracy
    hi = a.to(torch.bfloat16)
    two = P.wide_product(hi, b.to(torch.bfloat16)) + P.wide_product(
        hi, (b - b.to(torch.bfloat16).float()).to(torch.bfloat16)
    )
    assert _rel(two, exact) > 20 * float32
    # the Gram, right and left, from four products
    x = P.split(a.mT.contiguous())
    gram = a.double() @ a.double().mT
    assert _rel(P.split_gram(x), gram) < 4 * _rel(a @ a.mT, gram)
    assert _rel(P.split_gram(P.split(a), left=True), gram) < 4 * _rel(a @ a.mT, gram)


def test_inverse_square_root_with_split_products_matches_float32():
    D = _tall(1024, 128, 1e3, 1.0, torch.Generator().manual_seed(6))
    C = (D.mT @ D).float()
    exact = inv_sqrt(C.double(), 1e-8, "exact")
    f32 = _rel(inv_sqrt(C, 1e-8), exact)
    assert _rel(inv_sqrt(C, 1e-8, products="bfloat16x6"), exact) < max(2 * f32, 1e-3)
    with pytest.raises(ValueError, match="unknown products 'tf32'"):
        inv_sqrt(C, 1e-8, products="tf32")


# vocabulary-, MLP- and router-shaped work matrices (downsized), conditions up to 1e3
@pytest.mark.parametrize("m, n", SHAPES)
@pytest.mark.parametrize("cond", [1e3])
def test_split_products_keep_every_map_within_half_a_percent_of_float64(m, n, cond):
    """The bound the automatic choice is held to (``python -m equiopt.bench --accuracy``):
    half a percent of float64, or four times the strict float32 route's own error where the
    Gram's condition number (1e6) amplifies the rounding of any summation order beyond that
    (the products' order differs between CPU kernels)."""
    D = _tall(m, n, cond, 1e-2, torch.Generator().manual_seed(int(cond) + n))
    fns = [
        maps.right_spectral,
        lambda d, **k: maps.right_spectral(d, center=True, **k),
        lambda d, **k: maps.hybrid(d, scale="rms", **k),
        lambda d, **k: maps.hybrid(d, order="right_then_row", center=True, **k),
    ]
    for fn in fns:
        exact = fn(D)
        split = fn(D.float(), gram_dtype="bfloat16x6")
        assert split.dtype == torch.float32
        f32 = _rel(fn(D.float(), gram_dtype="float32"), exact)
        assert _rel(split, exact) < max(0.005, 4 * f32)
    W = D.mT.contiguous()  # the router form: a wide, centred left map
    exact = maps.left_spectral(W, center=True)
    assert _rel(maps.left_spectral(W.float(), center=True, gram_dtype="bfloat16x6"), exact) < 0.005


def test_split_products_keep_the_maps_equivariant():
    fn = lambda d: maps.hybrid(d, gram_dtype="bfloat16x6")
    assert check_equivariance(fn, "lpro", (2, 96, 24), dtype=torch.float32) < 1e-4
    router = lambda d: maps.left_spectral(d, center=True, gram_dtype="bfloat16x6")
    assert check_equivariance(router, "router", (2, 24, 96), dtype=torch.float32) < 1e-4


def _precision(shape, cuda, gram_dtype, dtype=torch.float32):
    """What ``gram_precision`` takes for a matrix of ``shape`` on CUDA or on a CPU (a meta
    tensor deciding as either)."""
    with decide_as("cuda" if cuda else "cpu"):
        return maps.gram_precision(torch.empty(shape, dtype=dtype, device="meta"), gram_dtype)


def test_auto_takes_split_products_on_cuda_for_wide_matrices_only(monkeypatch):
    monkeypatch.setattr(maps.precision, "OUT_DTYPE_MM", True)
    big, small = (4096, maps.AUTO_SPLIT_MIN), (4096, maps.AUTO_SPLIT_MIN - 1)
    assert _precision(big, True, "auto") == "bfloat16x6"
    assert _precision(small, True, "auto") == "float32"
    assert _precision(big, False, "auto") == "float32"
    assert _precision(big, True, "auto", torch.float64) == "float32"
    assert _precision(big, True, None) == "float32"
    assert _precision(big, False, "bfloat16x6") == "bfloat16x6"
    monkeypatch.setattr(maps.precision, "OUT_DTYPE_MM", False)  # no fast product: strict float32 is faster
    assert _precision(big, True, "auto") == "float32"
    with pytest.raises(ValueError, match="unknown gram_dtype 'tf32'"):
        _precision(big, True, "tf32")


def test_optimizer_split_setting_steps_as_float32_and_skips_nonfinite():
    g = torch.Generator().manual_seed(7)
    W = torch.nn.Parameter(torch.randn(256, 32, generator=g))
    V = torch.nn.Parameter(W.detach().clone())
    ours = EquivariantOptimizer([{"params": [W], "rule": "hybrid", "lr": 0.01, "gram_dtype": "BFloat16x6"}])
    ref = EquivariantOptimizer([{"params": [V], "rule": "hybrid", "lr": 0.01, "gram_dtype": "float32"}])
    assert ours.param_groups[0]["gram_dtype"] == "bfloat16x6"
    start = W.detach().clone()
    for _ in range(3):
        grad = torch.randn(256, 32, generator=g)
        W.grad, V.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    assert not torch.equal(W, V) and _rel(W - start, V - start) < 1e-4
    W.grad = torch.full_like(W, float("nan"))
    before = W.detach().clone()
    ours.step()
    assert torch.equal(W, before) and ours.nonfinite_steps == 1
