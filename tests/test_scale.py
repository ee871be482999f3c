"""The scale-transferable update size ``scale="rms"`` of the one-sided and hybrid maps."""

import pytest
import reference as ref
import torch

import equiopt as eo
from equiopt import maps
from equiopt.diagnostics import check_equivariance
from equiopt.optim import EquivariantOptimizer
from equiopt.recipes import get_recipe

EPS = 1e-8


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def as_f32(fn):
    return lambda D: fn(D.float()).double()


def rms(U):
    return U.pow(2).mean().sqrt().item()


# ---------------------------------------------------------------- formula (float64)
def _rho_factor(X, alpha, rows, centered):
    """rho^alpha sqrt(rows n / r), written from the singular values of X."""
    s = torch.linalg.svdvals(X)
    n = X.shape[1]
    r = min(rows - 1 if centered else rows, n) if isinstance(rows, int) else min(rows, n)
    damp = EPS * (s**2).sum().item() / min(X.shape)  # relative damping (the default)
    nu = (s**2 / (s**2 + damp).sqrt()).sum().item()
    rho = nu / (r**0.5 * X.norm().item())
    return min(rho, 1.0) ** alpha * (rows * n / r) ** 0.5


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_exact_one_sided_rms_matches_formula(centered, alpha):
    D = randn(30, 7, seed=1)
    P = ref.projector(30) if centered else torch.eye(30, dtype=D.dtype)
    want = ref.right(D, EPS, 0.0, centered) * _rho_factor(P @ D, alpha, 30, centered)
    got = maps.right_spectral(D, EPS, alpha, centered, method="exact", scale="rms")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    E = D.T.contiguous()  # router-like: 7 x 30, the left map
    Pe = ref.projector(7) if centered else torch.eye(7, dtype=D.dtype)
    want = ref.left(E, EPS, 0.0, centered) * _rho_factor(Pe @ E, alpha, 7, centered)
    got = maps.left_spectral(E, EPS, alpha, centered, method="exact", scale="rms")
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_exact_hybrid_rms_matches_formula(centered, alpha):
    D = randn(40, 9, seed=3)
    D[[2, 11, 30]] = 0.0  # rows never seen: the row count is the nonzero rows
    P = ref.projector(40) if centered else torch.eye(40, dtype=D.dtype)
    M = P @ D
    Z = P @ ref.row_diag(M, EPS) @ M
    sq = (Z**2).sum(1)
    k = (sq.sum() ** 2 / (sq**2).sum()).item()
    want = P @ (ref.right(Z, EPS, 0.0) * _rho_factor(Z, alpha, k, centered))
    got = maps.hybrid(D, "row_then_right", EPS, alpha, centered, method="exact", scale="rms")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # the *_then_row orders: the paper's map with rows of unit RMS (times sqrt(n)), up to
    # the eps of eta(t) = 1 / (t + eps), which sees a differently scaled first stage
    for order, E in (("right_then_row", D), ("left_then_row", randn(6, 20, seed=4))):
        got = maps.hybrid(E, order, EPS, alpha, centered, method="exact", scale="rms")
        torch.testing.assert_close(
            got, ref.hybrid(E, order, EPS, alpha, centered) * E.shape[1] ** 0.5, rtol=1e-5, atol=1e-7
        )


def test_nu_is_the_default_and_unknown_scale_is_rejected():
    D = randn(16, 8, seed=5)
    torch.testing.assert_close(maps.hybrid(D), maps.hybrid(D, scale="nu"))
    with pytest.raises(ValueError, match="scale"):
        maps.right_spectral(D, scale="unit")
    with pytest.raises(ValueError, match="scale"):
        maps.hybrid(D, scale="unit")


# -------------------------------------------------------------- equivariance
RMS_LPRO = {
    "right_a0": lambda D: maps.right_spectral(D, scale="rms"),
    "right_a1": lambda D: maps.right_spectral(D, alpha=1.0, scale="rms"),
    "hybrid_row_then_right": lambda D: maps.hybrid(D, "row_then_right", scale="rms"),
    "hybrid_right_then_row": lambda D: maps.hybrid(D, "right_then_row", scale="rms"),
    "hybrid_gram_ns": lambda D: maps.hybrid(D, method="gram_newton_schulz", steps=8, scale="rms"),
}
RMS_ROUTER = {
    "left_centered_a1": lambda D: maps.left_spectral(D, alpha=1.0, center=True, scale="rms"),
    "hybrid_left_then_row": lambda D: maps.hybrid(D, "left_then_row", center=True, scale="rms"),
}
RMS_HEAD = {
    "right_centered_a1": lambda D: maps.right_spectral(D, alpha=1.0, center=True, scale="rms"),
    "hybrid_centered": lambda D: maps.hybrid(D, "row_then_right", center=True, scale="rms"),
}


@pytest.mark.parametrize("name", sorted(RMS_LPRO))
def test_rms_maps_are_lpro_equivariant(name):
    fn = as_f32(RMS_LPRO[name])
    tol = 2e-4 if "gram_ns" in name else 2e-5
    assert check_equivariance(fn, "lpro", (2, 48, 12)) < tol
    assert check_equivariance(lambda D: fn(D.mT).mT, "lpro_t", (2, 12, 48)) < tol


def test_rms_one_sided_maps_stay_biorthogonal():
    for alpha in (0.0, 1.0):
        fn = as_f32(lambda D: maps.right_spectral(D, alpha=alpha, scale="rms"))
        assert check_equivariance(fn, "biorthogonal", (2, 40, 16)) < 2e-5


@pytest.mark.parametrize("name", sorted(RMS_ROUTER))
def test_rms_router_maps_are_compatible(name):
    assert check_equivariance(as_f32(RMS_ROUTER[name]), "router", (2, 8, 40)) < 2e-5


@pytest.mark.parametrize("name", sorted(RMS_HEAD))
def test_rms_lm_head_maps_are_equivariant_and_horizontal(name):
    fn = as_f32(RMS_HEAD[name])
    assert check_equivariance(fn, "router", (2, 64, 8)) < 2e-5
    assert check_equivariance(fn, "lpro", (2, 64, 8)) < 2e-5


def test_rms_map_is_scale_free_and_batched_equals_loop():
    D = randn(4, 40, 12, seed=6, dtype=torch.float32)
    for fn in (lambda X: maps.hybrid(X, scale="rms"), lambda X: maps.right_spectral(X, alpha=1.0, scale="rms")):
        torch.testing.assert_close(fn(1000.0 * D), fn(D), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fn(D), torch.stack([fn(d) for d in D]), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------- size independent of shape
SHAPES = [(v, d) for v in (1024, 4096) for d in (64, 128, 256)]


def test_rms_update_size_is_independent_of_width_and_vocabulary():
    got, paper = {}, {}
    for v, d in SHAPES:
        D = randn(v, d, seed=v + d, dtype=torch.float32) * 0.01
        got[v, d] = rms(maps.hybrid(D, scale="rms"))
        paper[v, d] = rms(maps.hybrid(D))
        assert 0.95 < rms(maps.right_spectral(D, alpha=1.0, scale="rms")) <= 1.0 + 1e-3
        assert abs(rms(maps.hybrid(D, center=True, scale="rms")) - got[v, d]) < 1e-2
    assert all(0.95 < r <= 1.0 + 1e-3 for r in got.values()), got
    assert max(got.values()) / min(got.values()) < 1.05
    # the paper's nu^alpha: the RMS grows like sqrt(width)
    assert paper[1024, 256] / paper[1024, 64] > 1.8


def test_rms_nonzero_rows_keep_unit_size_when_most_rows_are_zero():
    for v in (1024, 4096):
        D = torch.zeros(v, 64)
        D[:300] = randn(300, 64, seed=v, dtype=torch.float32)
        U = maps.hybrid(D, scale="rms")
        assert U[300:].abs().max() == 0
        assert 0.9 < rms(U[:300]) <= 1.0 + 1e-3


# ----------------------------------------------------------- optimizer, recipes
def test_optimizer_group_scale_applies_the_map():
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(0.02 * torch.randn(64, 16, generator=g))
    grad = torch.randn(64, 16, generator=g)
    opt = EquivariantOptimizer([{"params": [p], "rule": "hybrid", "scale": "rms", "lr": 0.1, "beta": 0.0}])
    before = p.detach().clone()
    p.grad = grad.clone()
    opt.step()
    torch.testing.assert_close(before - p.detach(), 0.1 * maps.hybrid(grad, scale="rms"), rtol=1e-4, atol=1e-6)
    top = EquivariantOptimizer([p], rule="right", alpha=1.0, scale="rms")
    assert top.param_groups[0]["scale"] == "rms"
    with pytest.raises(ValueError, match="scale"):
        EquivariantOptimizer([{"params": [p], "rule": "hybrid", "scale": "unit"}])


def test_recipe_field_scale():
    recipe = get_recipe("paper:qwen3:a-ii")
    assert recipe.settings("embedding")["scale"] == "nu"  # the paper's, by default
    tuned = recipe.with_overrides({"embedding": {"scale": "rms", "lr": 0.01}})
    assert tuned.settings("embedding")["scale"] == "rms"
    with pytest.raises(ValueError, match="scale"):
        recipe.with_overrides({"embedding": {"scale": "unit"}})
    with pytest.raises(ValueError, match="scale"):
        get_recipe("paper:qwen3:a-i").with_overrides({"embedding": {"scale": "rms"}})  # row rule: no such field
    model = eo.models.build("qwen3", "tiny")
    opt, _ = eo.build_optimizer(model, recipe=tuned)
    assert {g["scale"] for g in opt.param_groups if g.get("role") == "embedding"} == {"rms"}
