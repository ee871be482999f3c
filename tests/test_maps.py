import pytest
import reference as ref
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from equiopt import maps
from equiopt.diagnostics import check_equivariance

EPS = 1e-8


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def as_f32(fn):
    """Run ``fn`` in float32 (the practical oracles) and return float64 for the checker."""
    return lambda D: fn(D.float()).double()


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("damping", ["relative", "absolute"])
@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_exact_one_sided_maps_match_float64_formulas(centered, alpha, damping):
    D = randn(3, 30, 7, seed=1)
    for b in range(3):
        got_r = maps.right_spectral(D, EPS, alpha, centered, method="exact", damping=damping)[b]
        torch.testing.assert_close(got_r, ref.right(D[b], EPS, alpha, centered, damping), rtol=1e-10, atol=1e-10)
        E = D[b].T.contiguous()  # wide: router-like (7 experts x 30 features)
        got_l = maps.left_spectral(E, EPS, alpha, centered, method="exact", damping=damping)
        torch.testing.assert_close(got_l, ref.left(E, EPS, alpha, centered, damping), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("centered", [False, True])
def test_row_norm_matches_formula(centered):
    D = randn(20, 6, seed=2)
    torch.testing.assert_close(maps.row_norm(D, EPS, centered), ref.row(D, EPS, centered), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("damping", ["relative", "absolute"])
@pytest.mark.parametrize("order", ["row_then_right", "right_then_row", "left_then_row"])
@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_exact_hybrid_matches_algorithm_2(order, centered, alpha, damping):
    D = randn(12, 9, seed=3) if order != "left_then_row" else randn(6, 20, seed=3)
    got = maps.hybrid(D, order, EPS, alpha, centered, method="exact", damping=damping)
    torch.testing.assert_close(got, ref.hybrid(D, order, EPS, alpha, centered, damping), rtol=1e-10, atol=1e-10)


def test_spectral_exact_is_polar_factor():
    D = randn(2, 10, 25, seed=4)
    got = maps.spectral(D, method="exact")
    torch.testing.assert_close(got[1], ref.polar(D[1]), rtol=1e-10, atol=1e-10)


# -------------------------------------------------------------- equivariance
LPRO_MAPS = {
    "row_norm": lambda D: maps.row_norm(D),
    "right_spectral": lambda D: maps.right_spectral(D),
    "right_spectral_alpha": lambda D: maps.right_spectral(D, alpha=1.0),
    "hybrid_row_then_right": lambda D: maps.hybrid(D, "row_then_right"),
    "hybrid_right_then_row": lambda D: maps.hybrid(D, "right_then_row"),
}
ROUTER_MAPS = {
    "left_centered": lambda D: maps.left_spectral(D, center=True),
    "left_centered_alpha": lambda D: maps.left_spectral(D, center=True, alpha=1.0),
    "row_centered": lambda D: maps.row_norm(D, center=True),
    "hybrid_left_then_row": lambda D: maps.hybrid(D, "left_then_row", center=True),
}
LM_HEAD_MAPS = {
    "row_centered": lambda D: maps.row_norm(D, center=True),
    "right_centered": lambda D: maps.right_spectral(D, center=True),
    "hybrid_centered": lambda D: maps.hybrid(D, "row_then_right", center=True),
}


@pytest.mark.parametrize("name", sorted(LPRO_MAPS))
def test_lpro_maps_are_equivariant(name):
    fn = as_f32(LPRO_MAPS[name])
    assert check_equivariance(fn, "lpro", (2, 48, 12)) < 2e-5
    # the transposed geometry (down projections): apply to the transpose
    assert check_equivariance(lambda D: fn(D.mT).mT, "lpro_t", (2, 12, 48)) < 2e-5


@pytest.mark.parametrize("name", sorted(ROUTER_MAPS))
def test_router_maps_are_compatible(name):
    assert check_equivariance(as_f32(ROUTER_MAPS[name]), "router", (2, 8, 40)) < 2e-5


@pytest.mark.parametrize("name", sorted(LM_HEAD_MAPS))
def test_lm_head_maps_are_permutation_equivariant_shift_invariant_and_horizontal(name):
    fn = as_f32(LM_HEAD_MAPS[name])
    assert check_equivariance(fn, "router", (2, 64, 8)) < 2e-5
    assert check_equivariance(fn, "lpro", (2, 64, 8)) < 2e-5


def test_spectral_is_biorthogonally_equivariant():
    fn = as_f32(lambda D: maps.spectral(D, dtype=torch.float32))
    assert check_equivariance(fn, "biorthogonal", (2, 40, 16)) < 2e-5
    assert check_equivariance(as_f32(lambda D: maps.right_spectral(D)), "biorthogonal", (2, 40, 16)) < 2e-5


def test_checker_reports_maps_that_are_not_equivariant():
    adam_like = lambda D: D / (D.abs() + 1e-8)
    assert check_equivariance(adam_like, "lpro", (2, 20, 8)) > 0.1
    assert check_equivariance(maps.row_norm, "biorthogonal", (2, 20, 8)) > 0.1  # not left-rotation equivariant
    # uncentred left-polar is not shift invariant / horizontal
    assert check_equivariance(as_f32(lambda D: maps.left_spectral(D)), "router", (2, 8, 40)) > 0.1
    # uncentred row norm fails the router group but not lpro
    assert check_equivariance(maps.row_norm, "router", (2, 8, 40)) > 0.1
    # a map that leaks reductions across the batch fails the per-matrix group test
    leaky = lambda D: D / torch.linalg.vector_norm(D, dim=-1, keepdim=True).mean(dim=0, keepdim=True)
    assert check_equivariance(leaky, "lpro", (3, 20, 8)) > 0.1


def test_checker_rejects_unknown_group():
    with pytest.raises(ValueError, match="valid"):
        check_equivariance(maps.row_norm, "affine", (4, 4))


# ------------------------------------------------------- structural properties
@pytest.mark.parametrize(
    "fn",
    [
        lambda D: maps.row_norm(D, center=True),
        lambda D: maps.right_spectral(D, center=True),
        lambda D: maps.left_spectral(D, center=True),
        lambda D: maps.hybrid(D, "row_then_right", center=True),
        lambda D: maps.hybrid(D, "right_then_row", center=True),
        lambda D: maps.hybrid(D, "left_then_row", center=True),
    ],
)
def test_centred_maps_are_horizontal(fn):
    D = randn(3, 16, 24, seed=5, dtype=torch.float32) + 3.0  # a large shared-row component
    U = fn(D)
    assert (U.sum(dim=-2).abs().max() / U.abs().max()) < 1e-5


@pytest.mark.parametrize(
    "fn",
    [
        maps.row_norm,
        maps.right_spectral,
        maps.left_spectral,
        maps.spectral,
        lambda D: maps.right_spectral(D, alpha=1.0, center=True),
        lambda D: maps.hybrid(D, "row_then_right", center=True),
        lambda D: maps.hybrid(D, "left_then_row", center=True),
    ],
)
def test_batched_equals_loop(fn):
    # float64: batching is tested, not float32 rounding, which a batched product's kernel sums in
    # another order than a single one's and an inverse square root amplifies
    D = randn(5, 24, 10, seed=6, dtype=torch.float64)
    batched = fn(D)
    loop = torch.stack([fn(d) for d in D])
    torch.testing.assert_close(batched, loop, rtol=1e-9, atol=1e-11)
    # the same matrices inside a bigger batch with different neighbours give the same answer
    bigger = fn(torch.cat([D, 100.0 * randn(3, 24, 10, seed=7, dtype=torch.float64)]))[:5]
    torch.testing.assert_close(bigger, batched, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(
    "fn",
    [
        maps.row_norm,
        maps.right_spectral,
        lambda D: maps.row_norm(D, center=True),
        lambda D: maps.hybrid(D, "row_then_right"),
        lambda D: maps.hybrid(D, "right_then_row", alpha=1.0),
    ],
)
def test_zero_rows_give_zero_update_never_nan(fn):
    D = randn(32, 8, seed=8, dtype=torch.float32)
    D[[3, 7, 20]] = 0.0
    U = fn(D)
    assert torch.isfinite(U).all()
    if fn is maps.row_norm or fn is maps.right_spectral:
        assert U[[3, 7, 20]].abs().max() == 0
    assert torch.isfinite(fn(torch.zeros(16, 8))).all()


def test_zero_matrix_router_is_finite():
    U = maps.hybrid(torch.zeros(8, 32), "left_then_row", center=True)
    assert torch.isfinite(U).all() and U.abs().max() == 0


def test_bfloat16_input_returns_bfloat16_computed_in_float32():
    D = randn(64, 16, seed=9, dtype=torch.float32)
    out = maps.right_spectral(D.bfloat16())
    assert out.dtype == torch.bfloat16
    ref32 = maps.right_spectral(D.bfloat16().float())
    torch.testing.assert_close(out.float(), ref32, rtol=1e-2, atol=1e-2)


def test_eta_rules():
    D = randn(10, 4, seed=10)
    D[2] = 0
    n = torch.linalg.vector_norm(maps.row_norm(D, eta="normalize"), dim=-1)
    assert torch.allclose(n[[0, 1, 3]], torch.ones(3, dtype=torch.float64)) and n[2] == 0
    r = maps.row_norm(D, eta="rms")
    torch.testing.assert_close(r.pow(2).mean(-1)[0], torch.tensor(1.0, dtype=torch.float64))
    custom = maps.row_norm(D, eta=lambda t: 2.0 / (t + 1.0))
    torch.testing.assert_close(custom[0], 2.0 * D[0] / (D[0].norm() + 1.0))
    with pytest.raises(ValueError, match="eta"):
        maps.row_norm(D, eta="sqrt")
    with pytest.raises(ValueError, match="order"):
        maps.hybrid(D, "row_then_left")


def test_one_dimensional_input_is_rejected():
    with pytest.raises(ValueError, match="row_norm"):
        maps.row_norm(torch.ones(5))


@settings(max_examples=25, deadline=None)
@given(m=st.integers(2, 12), n=st.integers(1, 12), seed=st.integers(0, 10_000), centered=st.booleans())
def test_row_norm_property_rows_have_unit_norm_after_scaling(m, n, seed, centered):
    D = randn(m, n, seed=seed)
    U = maps.row_norm(D, eps=0.0 + 1e-300, center=False)
    norms = torch.linalg.vector_norm(U, dim=-1)
    assert torch.allclose(norms, torch.ones(m, dtype=torch.float64))
    if centered:
        V = maps.row_norm(D, center=True)
        assert V.sum(dim=0).abs().max() < 1e-10


@settings(max_examples=20, deadline=None)
@given(m=st.integers(2, 20), n=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_right_spectral_property_orthonormal_columns(m, n, seed):
    if m < n:
        return
    D = randn(m, n, seed=seed)
    U = maps.right_spectral(D, eps=1e-14, method="exact")
    torch.testing.assert_close(U.T @ U, torch.eye(n, dtype=torch.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(30, 7), (7, 30)])
@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_gram_sides_agree(shape, centered, alpha):
    """D (D^T D + eps I)^(-1/2) = (D D^T + eps I)^(-1/2) D, nu included: either Gram may be used."""
    D = randn(*shape, seed=11)
    right = maps.right_spectral(D, EPS, alpha, centered, method="exact", gram="right")
    left = maps.right_spectral(D, EPS, alpha, centered, method="exact", gram="left")
    assert (right - left).norm() / right.norm() < 1e-10
    assert (maps.left_spectral(D, EPS, alpha, centered, method="exact") - right).norm() / right.norm() < 1e-10
    fast = maps.right_spectral(D.float(), EPS, alpha, centered)  # auto: the smaller Gram
    assert (fast.double() - right).norm() / right.norm() < 5e-3
    with pytest.raises(ValueError, match="gram"):
        maps.right_spectral(D, gram="both")


@pytest.mark.parametrize("shape", [(37, 5), (3, 50, 8)])
@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("scale", ["nu", "rms"])
def test_unformed_first_stage_equals_the_formed_one(monkeypatch, shape, centered, scale):
    """The hybrid's row-normalised stage taken a block of rows at a time (uneven blocks of
    3 rows here) gives the update of the formed ``Z``, in factored form and added to
    weights, and leaves the input untouched."""
    import equiopt.maps as M
    from equiopt.maps import hybrids
    from equiopt.optim.apply import add_factored_

    gen = torch.Generator().manual_seed(3)
    D = torch.randn(shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen)
    kw = dict(center=centered, scale=scale, method="exact")
    monkeypatch.setitem(M.STAGE_BLOCK_BYTES, "cpu", 3 * shape[-1] * 4 * (shape[0] if len(shape) == 3 else 1))
    assert len(M.row_blocks(D)) == -(-shape[-2] // 3)
    before = D.clone()
    f = M.hybrid_factored(D, **kw)
    assert f.row is not None and f.right is not None and (f.x is D or centered)  # centred: a centred copy
    assert torch.equal(D, before)
    monkeypatch.setattr(hybrids, "unformed_stage", lambda *a: False)  # where hybrid_factored reads it
    formed = M.hybrid_factored(D, **kw)
    assert formed.row is None and formed.right is not None
    want = M.materialize(formed)
    assert torch.allclose(M.materialize(f), want, rtol=1e-5, atol=1e-6)
    w = torch.randn(shape, generator=gen)
    out = w.clone()
    add_factored_(out, f, torch.tensor(-0.1))
    assert torch.allclose(out, w - 0.1 * want, rtol=1e-5, atol=1e-6)
