"""route: the one-sided and hybrid maps by the Gram route (Gram, coupled inverse square
root, product) or the direct route (Polar Express on the matrix itself, as Muon), their
accuracy against float64, where they differ (damping), equivariance, the automatic
choice, and the setting from recipes to the engine."""

import sys

import pytest
import torch

import equiopt as eo
from equiopt import maps
from equiopt.bench import _tall
from equiopt.diagnostics.equivariance import check_equivariance
from equiopt.linalg import polar
from equiopt.linalg.device_choices import decide_as
from equiopt.optim import EquivariantOptimizer
from equiopt.optim.rules import map_key, reducible
from equiopt.roofline import RooflineCounter


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


# vocabulary-, MLP- and router-shaped work matrices (downsized), well conditioned
SHAPES = [(2048, 128), (768, 256), (1024, 32)]


@pytest.mark.parametrize("m, n", SHAPES)
def test_direct_route_error_is_muons_own_iteration_error(one_thread, m, n):
    D = _tall(m, n, 10.0, 1e-2, torch.Generator().manual_seed(m))
    exact = maps.right_spectral(D)  # float64: D (D^T D + eps I)^(-1/2)
    muon = polar(D.float(), "polar_express", 5)  # Muon's iteration, same dtype and steps
    direct = maps.right_spectral(D.float(), route="direct")
    assert direct.dtype == torch.float32
    assert _rel(direct, exact) == pytest.approx(_rel(muon, exact), rel=1e-3, abs=1e-6)
    # and nu = tr(D^T P), the nuclear-norm factor, to the same accuracy
    scaled = maps.right_spectral(D.float(), alpha=1.0, route="direct")
    nu_exact = float(torch.linalg.svdvals(D).sum())
    nu = float((scaled.double() * direct.double()).sum() / direct.double().square().sum())
    assert abs(nu / nu_exact - 1) <= 1.2 * _rel(muon, exact)


@pytest.mark.parametrize("m, n", SHAPES)
def test_routes_agree_to_muons_accuracy_where_damping_is_negligible(one_thread, m, n):
    D = _tall(m, n, 10.0, 1e-2, torch.Generator().manual_seed(m + 1))
    err = _rel(polar(D.float(), "polar_express", 5), maps.right_spectral(D))
    assert err < 0.15  # Polar Express's five steps end in [0.88, 1.12]
    cases = [
        (maps.right_spectral, {}),
        (maps.right_spectral, {"alpha": 1.0}),
        (maps.right_spectral, {"center": True}),
        (maps.hybrid, {}),
        (maps.hybrid, {"scale": "rms"}),
        (maps.hybrid, {"order": "right_then_row", "center": True}),
    ]
    for fn, kw in cases:
        gram = fn(D.float(), route="gram", **kw)
        direct = fn(D.float(), route="direct", **kw)
        assert _rel(gram, fn(D, **kw)) < 1e-3, (fn.__name__, kw)
        assert _rel(direct, gram) <= 1.3 * err, (fn.__name__, kw)
    # the router's centred left map: centring comes before either route
    W = D.mT.contiguous()
    gram = maps.left_spectral(W.float(), center=True)
    direct = maps.left_spectral(W.float(), center=True, route="direct")
    assert direct.float().sum(dim=-2).abs().max() < 1e-4  # still horizontal
    assert _rel(direct, gram) <= 1.3 * err


def test_damping_is_where_the_routes_differ(one_thread):
    """With eps not negligible against a squared singular value the Gram route damps that
    direction towards 0; the direct route, undamped, maps it towards 1 as Muon does."""
    g = torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(torch.randn(512, 64, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    s = torch.ones(64, dtype=torch.float64)
    s[-4:] = 0.05  # squared 2.5e-3, below the damping (5e-2 times the mean eigenvalue)
    D = ((u * s) @ v.T).float()
    gram = torch.linalg.svdvals(maps.right_spectral(D, eps=5e-2).double())
    direct = torch.linalg.svdvals(maps.right_spectral(D, eps=5e-2, route="direct").double())
    assert gram[-4:].max() < 0.3 and direct[-4:].min() > 0.8
    # a rank-deficient matrix: the Gram route's damping keeps its null directions at 0;
    # the direct route amplifies what the iteration's rounding puts there (in bfloat16
    # about 0.2 after five steps), as Muon does
    D = (u[:, :60] @ v[:, :60].T).float()
    gram = torch.linalg.svdvals(maps.right_spectral(D).double())
    direct = torch.linalg.svdvals(maps.right_spectral(D, route="direct").double())
    assert gram[-4:].max() < 1e-2 and direct[-4:].max() < 0.5
    assert gram[:60].min() > 0.99 and direct[:60].min() > 0.8


@pytest.mark.parametrize(
    "fn, group, shape",
    [
        (lambda d: maps.right_spectral(d, route="direct"), "biorthogonal", (2, 96, 24)),
        (lambda d: maps.hybrid(d, route="direct"), "lpro", (2, 96, 24)),
        (lambda d: maps.hybrid(d, order="right_then_row", route="direct"), "lpro", (2, 96, 24)),
        (lambda d: maps.left_spectral(d, center=True, route="direct"), "router", (2, 24, 96)),
    ],
)
def test_direct_route_is_equivariant(one_thread, monkeypatch, fn, group, shape):
    # in the iteration's default dtype: bfloat16 where the CPU multiplies it natively, whose
    # rounding differs under a rotated input, so equivariance holds to that rounding
    assert check_equivariance(fn, group, shape, dtype=torch.float32) < 0.1
    # float32 iterations: to float32's rounding
    monkeypatch.setattr(sys.modules["equiopt.linalg.polar"], "CPU_BFLOAT16", False)
    assert check_equivariance(fn, group, shape, dtype=torch.float32) < 5e-5
    perm = "permutation" if group != "router" else "router"
    assert check_equivariance(fn, perm, shape, dtype=torch.float32) < 5e-5


# ------------------------------------------------------------------ the choice


def test_route_flops_by_hand():
    k, r, s = 3072, 1024, 5
    gram = maps.route_flops(k, r, s, "gram", "float32", torch.bfloat16)
    assert gram == {"float32": 2 * (2 * k * r * r) + (8 * s + 2) * r**3}  # Gram, 21 products, D R
    assert gram["float32"] == pytest.approx(58.0e9, rel=0.01)
    direct = maps.route_flops(k, r, s, "direct", "float32", torch.bfloat16)
    assert direct == {"bfloat16": s * (4 * k * r * r + 2 * r**3)}
    assert direct["bfloat16"] == pytest.approx(75.2e9, rel=0.01)
    split = maps.route_flops(k, r, s, "gram", "bfloat16x6", torch.bfloat16)
    assert split == {"bfloat16": 20 * k * r * r + 6 * (8 * s + 2) * r**3}
    # wide matrices count by their smaller side
    assert maps.route_flops(r, k, s, "direct", "float32", torch.float32) == {"float32": direct["bfloat16"]}


def test_roofline_counts_the_direct_route_as_its_flops():
    x = _meta(3072, 1024)
    with decide_as("cuda"), RooflineCounter() as c:
        maps.right_spectral(x, alpha=1.0, route="auto", gram_dtype="auto")
    flops = c.flops_by_dtype()
    assert set(flops) == {"bfloat16", "float32"}
    assert flops["bfloat16"] == maps.route_flops(3072, 1024, 5, "direct", "bfloat16x6", torch.bfloat16)["bfloat16"]
    # and nu = tr(U^T D), one float32 dot product over the matrix
    assert flops["float32"] == 2 * 3072 * 1024


@pytest.mark.parametrize(
    "shape", [(3072, 1024), (1024, 3072), (151936, 1024), (1024, 1024), (8, 1024), (4, 96, 256), (2048, 32)]
)
@pytest.mark.parametrize("gram_dtype", ["auto", "float32", "bfloat16x6", None])
def test_auto_takes_direct_on_cuda_where_it_costs_less(shape, gram_dtype):
    with decide_as("cuda"):
        x = _meta(*shape)
        costs = maps.route_costs(x, gram_dtype=gram_dtype)
        assert costs is not None and costs["direct"] < costs["gram"]
        assert maps.one_sided_route(x, "auto", gram_dtype=gram_dtype) == "direct"
        for fixed in ("gram", "direct"):
            assert maps.one_sided_route(x, fixed, gram_dtype=gram_dtype) == fixed


def test_auto_weighs_the_precision_of_each_routes_products():
    """One bfloat16 Gram (``gram_dtype="bfloat16"``) costs two products of the tall side
    against the direct route's ten: a vocabulary keeps the Gram route, an MLP matrix,
    whose 1024 x 1024 inverse square root in float32 dominates, does not."""
    with decide_as("cuda"):
        vocab, mlp = _meta(151936, 1024), _meta(3072, 1024)
        c = maps.route_costs(vocab, gram_dtype="bfloat16")
        assert c is not None and c["gram"] < c["direct"]
        assert maps.one_sided_route(vocab, "auto", gram_dtype="bfloat16") == "gram"
        assert maps.one_sided_route(mlp, "auto", gram_dtype="bfloat16") == "direct"


def test_auto_keeps_the_gram_route_off_cuda_and_where_the_direct_route_loses_precision():
    x = torch.zeros(3072, 1024)
    assert maps.route_costs(x) is None
    assert maps.one_sided_route(x, "auto") == "gram"  # a CPU: no rates, keep the Gram route
    assert maps.one_sided_route(_meta(3072, 1024), "auto") == "gram"  # meta deciding as itself
    with decide_as("cpu"):
        assert maps.one_sided_route(_meta(3072, 1024), "auto") == "gram"
    with decide_as("cuda"):
        assert maps.one_sided_route(_meta(3072, 1024, dtype=torch.float64), "auto") == "gram"
        assert maps.one_sided_route(_meta(3072, 1024), "auto", method="exact") == "gram"
        assert maps.one_sided_route(_meta(3072, 1024), "auto", method="newton_schulz") == "gram"


class _Sum:
    count = 4096

    def sum(self, t):
        return t


def test_a_row_sharded_matrix_keeps_the_gram_route():
    with decide_as("cuda"):
        x = _meta(1024, 1024)
        assert maps.one_sided_route(x, "auto", reducer=_Sum()) == "gram"
        with pytest.raises(ValueError, match="route 'direct' needs the whole work matrix"):
            maps.one_sided_route(x, "direct", reducer=_Sum())
        f = maps.one_sided_factored(x, reducer=_Sum(), route="auto")
        assert f.right is not None  # the Gram route's factor
    # the engine: "auto" reduces on the shards, "direct" is gathered to an owner rank
    group = dict(eo.optim.EquivariantOptimizer([torch.zeros(4, 4, requires_grad=True)], rule="hybrid").param_groups[0])
    assert reducible(map_key(group), 4096, 1024)
    assert not reducible(map_key({**group, "route": "direct"}), 4096, 1024)


# ------------------------------------------------------------------ the setting


def test_a_bad_route_is_refused_naming_the_setting():
    p = torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.raises(ValueError, match=r"field 'route': unknown route 'fast'; valid: auto, gram, direct"):
        EquivariantOptimizer([p], rule="right", route="fast")
    with pytest.raises(ValueError, match=r"param_groups\[0\], field 'route'"):
        EquivariantOptimizer([{"params": [p], "rule": "hybrid", "route": "grams"}])
    with pytest.raises(ValueError, match="unknown route 'x'"):
        maps.right_spectral(torch.zeros(8, 4), route="x")
    from equiopt.recipes.schema import normalize_settings

    with pytest.raises(ValueError, match="route"):
        normalize_settings({"rule": "hybrid", "lr": 0.1, "route": "fast"}, "embedding")
    with pytest.raises(ValueError, match="route"):
        normalize_settings({"rule": "spectral", "lr": 0.1, "route": "direct"}, "attention")


def test_route_flows_from_a_recipe_to_the_step(one_thread):
    model = eo.models.build("qwen3", "tiny", seed=0)
    opt, _ = eo.build_optimizer(model, "paper:qwen3:b-ii", overrides={"mlp_in": {"route": "direct"}})
    routes = {g["role"]: g["route"] for g in opt.param_groups if "route" in g and g["rule"] in ("hybrid", "right")}
    assert routes["mlp_in"] == "direct" and all(r == "auto" for k, r in routes.items() if k != "mlp_in")
    assert {g["route"] for g in eo.build_optimizer(model, "paper:qwen3:b-ii")[0].param_groups} == {"auto"}


@pytest.mark.parametrize("rule", ["right", "hybrid"])
def test_optimizer_steps_by_the_route_it_is_given(one_thread, rule):
    G = _tall(256, 32, 10.0, 1.0, torch.Generator().manual_seed(2)).float()
    updates = {}
    for route in ("auto", "gram", "direct"):
        W = torch.nn.Parameter(torch.zeros(256, 32))
        opt = EquivariantOptimizer([W], rule=rule, lr=1.0, beta=0.0, route=route)
        W.grad = G.clone()
        opt.step()
        updates[route] = -W.detach()
    fn = maps.right_spectral if rule == "right" else maps.hybrid
    assert _rel(updates["gram"], fn(G)) < 1e-4
    assert _rel(updates["direct"], fn(G, route="direct")) < 1e-4
    assert torch.equal(updates["auto"], updates["gram"])  # a CPU keeps the Gram route
    assert _rel(updates["direct"], updates["gram"]) > 1e-3  # the direct route ran
