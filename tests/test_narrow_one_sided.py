"""The direct route of the one-sided maps and hybrids (``route="direct"``) kept narrow in a
bucket: the polar factor in its iteration's dtype with the scale as a ``(..., 1, 1)`` row
factor, the row stage scaled into the iteration as it is normalised (never formed), ``nu``
read a block of rows at a time. Run with CUDA's choices (bfloat16 iterations)."""

import importlib
from functools import partial

import pytest
import torch
from test_narrow_polar import assert_a_bad_factor_adds_nothing

from equiopt import maps
from equiopt.linalg import polar
from equiopt.linalg.device_choices import decide_as
from equiopt.maps.one_sided import _dots
from equiopt.optim import EquivariantOptimizer
from equiopt.roofline import count_step

polar_module = importlib.import_module("equiopt.linalg.polar")


def _factored(rule, D, narrow, **kw):
    if rule == "right":
        return maps.one_sided_factored(D, route="direct", narrow=narrow, **kw)
    return maps.hybrid_factored(D, route="direct", narrow=narrow, **kw)


@pytest.mark.parametrize("rule", ["right", "hybrid"])
@pytest.mark.parametrize("scale", ["nu", "rms"])
@pytest.mark.parametrize("center", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize("shape", [(3, 40, 16), (2, 16, 40)], ids=["tall", "wide"])
def test_the_narrow_factor_with_its_scale_is_the_wide_update(rule, scale, center, shape):
    D = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    with decide_as("cuda"):
        wide = _factored(rule, D, False, alpha=1.0, scale=scale, center=center)
        narrow = _factored(rule, D, True, alpha=1.0, scale=scale, center=center)
    assert wide.x.dtype == torch.float32 and narrow.x.dtype == torch.bfloat16
    assert narrow.row is not None and narrow.row.shape == (*shape[:-2], 1, 1)
    torch.testing.assert_close(maps.materialize(narrow), maps.materialize(wide), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 12, 30), (2, 30, 12)], ids=["wide", "tall"])
def test_the_factor_of_scaled_rows_is_the_factor_of_the_scaled_matrix(dtype, shape):
    g = torch.Generator().manual_seed(5)
    X = torch.randn(shape, generator=g)
    row = torch.rand(*shape[:-1], 1, generator=g) + 0.2
    row[0, 1] = 0.0  # a row the stage zeroed stays zero
    with decide_as("cpu"):
        got = polar(X, dtype=dtype, row=row)
        ref = polar(X * row, dtype=dtype)
    exact = polar((X * row).double(), method="exact")
    assert torch.all(got[0, 1] == 0)
    # the same iteration on the same matrix up to the normalisation's rounding: as close to
    # the other as each is to the exact factor
    err_ref = (ref.double() - exact).norm() / exact.norm()
    assert (got.double() - ref.double()).norm() / exact.norm() <= max(1e-5, 0.5 * err_ref)
    assert (got.double() - exact).norm() / exact.norm() <= 1.1 * err_ref + 1e-6


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("with_row", [False, True])
def test_dots_agree_with_float64_in_blocks_of_rows(monkeypatch, layout, with_row):
    g = torch.Generator().manual_seed(6)
    b = torch.randn(3, 50, 8, generator=g)
    a = torch.randn(3, 8, 50, generator=g).to(torch.bfloat16).mT  # a narrow factor, transposed
    if layout == "transposed":
        b = b.mT.contiguous().mT
    row = torch.rand(3, 50, 1, generator=g) if with_row else None
    monkeypatch.setattr(polar_module, "CHUNK_BYTES", 3 * 8 * 4 * 7)  # blocks of 7 rows
    got = _dots(a, b, row)
    scaled = b.double() * (1.0 if row is None else row.double())
    want = (a.double() * scaled).sum(dim=(-2, -1)).view(3, 1, 1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


SHAPES = [(40, 16), (40, 16), (16, 40), (16, 40), (16, 40), (56, 24)]


def _run(rule: str, nonfinite: str, steps: int = 3, weight_decay: float = 0.1):
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    group = {"params": params, "rule": rule, "route": "direct", "alpha": 1.0, "weight_decay": weight_decay}
    opt = EquivariantOptimizer([{**group, "nonfinite": nonfinite}], lr=0.02)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


@pytest.mark.parametrize("rule", ["right", "hybrid"])
def test_a_bucket_adds_the_per_parameter_update_from_the_narrow_factor(rule):
    with decide_as("cuda"):
        bucketed, opt = _run(rule, "skip")
        single, ref = _run(rule, "raise")  # the per-parameter path: the wide update
    assert opt._buckets is not None and opt._buckets.covered == {id(p) for p in bucketed}
    assert ref._buckets is None or not ref._buckets.covered
    for a, b in zip(bucketed, single):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["right", "hybrid"])
def test_a_non_finite_narrow_factor_adds_nothing(monkeypatch, rule):
    def expect(kwargs, f):
        assert kwargs.get("narrow") and f.x.dtype == torch.bfloat16 and f.row is not None

    # -inf in one matrix of each bucket: its scale stays finite, the factor itself is read
    assert_a_bad_factor_adds_nothing(monkeypatch, partial(_run, rule, "skip"), float("-inf"), expect)


def test_the_row_stage_is_never_formed_whole():
    """A hybrid on one 151936 x 1024 embedding on the meta device, with CUDA's choices: the
    step holds the narrow factor and one iterate beside it, not the float32 row stage."""
    with torch.device("meta"), decide_as("cuda"):
        p = torch.nn.Parameter(torch.empty(151936, 1024))
        p.grad = torch.empty_like(p)
        opt = EquivariantOptimizer(
            [{"params": [p], "rule": "hybrid", "route": "direct", "alpha": 1.0}], lr=0.02, eager_state=True
        )
        counter = count_step(opt.step)
    factor = p.numel() * 2
    assert counter.peak_bytes < 2.5 * factor  # (the float32 stage alone is 2 factors)


@pytest.mark.parametrize("shape", [(3, 30, 12), (2, 12, 30)], ids=["tall", "wide"])
def test_the_factor_of_a_centred_row_stage_is_the_factor_of_the_formed_stage(shape):
    g = torch.Generator().manual_seed(8)
    X = torch.randn(shape, generator=g) + 3.0  # a large column mean: the shift matters
    row = torch.rand(*shape[:-1], 1, generator=g) + 0.2
    shift = (X * row).mean(dim=-2, keepdim=True)
    got = polar(X, dtype=torch.float32, row=row, shift=shift)
    ref = polar(X * row - shift, dtype=torch.float32)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the norm is the formed stage's, summed a block of rows at a time
    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.setattr(polar_module, "CHUNK_BYTES", 4 * shape[-1] * 4 * shape[0])  # blocks of 4 rows
        norm = polar_module._stage_norm(X, row, shift)
    finally:
        monkeypatch.undo()
    want = torch.linalg.matrix_norm((X * row - shift).double(), keepdim=True)
    torch.testing.assert_close(norm.double(), want, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("scale", ["nu", "rms"])
def test_a_centred_hybrid_on_its_stage_equals_the_map_of_the_formed_stage(scale):
    from equiopt.maps.one_sided import _one_sided_polar
    from equiopt.maps.row import _row_factors

    D = torch.randn(2, 48, 16, generator=torch.Generator().manual_seed(9)) + 2.0
    x = D - D.mean(dim=-2, keepdim=True)
    stage = _row_factors(x, "inverse", 1e-8, True)
    args = (1e-8, 1.0, 5, True, scale)
    formed = _one_sided_polar(maps.materialize(stage), *args, method="polar_express", dtype=torch.float32)
    staged = _one_sided_polar(stage, *args, method="polar_express", dtype=torch.float32, narrow=True)
    # the same iteration on the same matrix normalised in another order: the quintic steps
    # magnify the inputs' last-bit differences along the smallest singular values
    got, want = maps.materialize(staged), maps.materialize(formed)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    assert (got - want).norm() <= 1e-4 * want.norm()
