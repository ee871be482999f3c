"""The polar-factor hybrids: ``spectral_row`` (the polar factor, then its rows normalised)
and ``normuon`` (NorMuon: the polar factor, then its rows divided by the square roots of
their mean-square EMA, kept in ``state["row_second_moment"]``): against float64
transcriptions, equivariance under their group ``Perm(rows) x O(cols)``, every gradient
scale, the skip guarantees, layouts, buckets, checkpoints, presets and recipes."""

import pytest
import torch

import equiopt as eo
from equiopt.diagnostics.equivariance import check_equivariance
from equiopt.optim import EquivariantOptimizer

RULES = ["spectral_row", "normuon"]
BASE = {"method": "exact", "polar_dtype": torch.float64}


def _polar(d):
    u, _, vh = torch.linalg.svd(d, full_matrices=False)
    return u @ vh


def _reference(rule, grads, lr=0.1, beta=0.95, beta2=0.95, eps=1e-8):
    """Float64 transcription: weights from zero after stepping through ``grads`` (each ``m x n``)."""
    m, n = grads[0].shape
    w = torch.zeros(m, n, dtype=torch.float64)
    mom = torch.zeros_like(w)
    v = torch.zeros(m, 1, dtype=torch.float64)
    factor = max(1.0, m / n) ** 0.5
    for g in grads:
        mom = beta * mom + (1 - beta) * g
        o = _polar(beta * mom + (1 - beta) * g)  # Nesterov
        if rule == "spectral_row":
            z = o / (o.norm(dim=1, keepdim=True) + eps)
        else:
            v = beta2 * v + (1 - beta2) * o.pow(2).mean(dim=1, keepdim=True)
            z = o / (v.sqrt() + eps)
        u = z * (o.norm() / z.norm())
        w = w - lr * factor * u
    return w


def _weights(rule, grads, layout="row", lr=0.1, **extra):
    p = torch.nn.Parameter(torch.zeros(grads[0].shape, dtype=torch.float64))
    opt = EquivariantOptimizer([{"params": [p], "rule": rule, "layout": layout, **BASE, **extra}], lr=lr)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


@pytest.mark.parametrize("shape", [(12, 5), (5, 12)], ids=["tall", "wide"])
@pytest.mark.parametrize("rule", RULES)
def test_the_rules_match_their_float64_transcription(rule, shape):
    g = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(shape, generator=g, dtype=torch.float64) * torch.rand(shape[0], 1, generator=g, dtype=torch.float64)
        for _ in range(4)
    ]
    got, opt = _weights(rule, grads)
    torch.testing.assert_close(got, _reference(rule, grads), rtol=1e-9, atol=1e-11)
    if rule == "normuon":
        assert opt.state[opt.param_groups[0]["params"][0]]["row_second_moment"].shape == (shape[0],)


def _two_steps(rule):
    """The weights after two steps from zero, as a function of the first gradient ``D`` (the
    second, ``D D^T D / ||D||^2``, is equivariant in ``D``): exercises NorMuon's state."""

    def fn(d):
        out = []
        for x in d.reshape(-1, *d.shape[-2:]):
            grads = [x, x @ x.mT @ x / x.norm() ** 2]
            out.append(_weights(rule, grads)[0])
        return torch.stack(out).reshape(d.shape)

    return fn


@pytest.mark.parametrize("rule", RULES)
def test_equivariant_under_row_permutations_and_right_rotations_only(rule):
    assert check_equivariance(_two_steps(rule), "lpro", (2, 9, 4), trials=2) < 1e-9
    # row normalisation after the polar factor does not commute with left rotations
    assert check_equivariance(_two_steps(rule), "biorthogonal", (2, 9, 4), trials=2) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rule", RULES)
def test_every_gradient_scale_gives_the_same_finite_step(rule, dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 40, 16, generator=g) * torch.logspace(0, -2, 16)
    base = base * torch.rand(3, 40, 1, generator=g).add(0.1)
    rms = {}
    for k in range(-8, 9, 2):
        p = torch.nn.Parameter(torch.zeros(3, 40, 16, dtype=dtype))
        p.grad = (base / base.abs().amax() * 10.0**k).to(dtype)
        opt = EquivariantOptimizer([{"params": [p], "rule": rule, "layout": "experts:row"}], lr=0.01)
        opt.step()
        assert opt.nonfinite_steps == 0
        u = p.detach().double()
        assert torch.isfinite(u).all(), f"non-finite update at scale 1e{k}"
        rms[k] = u.pow(2).mean(dim=(-2, -1)).sqrt()
        assert (rms[k] > 0).all()
    for k in range(-6, 9, 2):
        ratio = rms[k] / rms[0]
        assert ((ratio > 0.5) & (ratio < 2.0)).all(), f"scale 1e{k}: {ratio.tolist()}"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e30])
@pytest.mark.parametrize("path", ["skip", "per-parameter"])
@pytest.mark.parametrize("rule", RULES)
def test_unusable_gradients_leave_weights_and_state_untouched(rule, path, bad):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(10, 4, generator=g)) for _ in range(2)]
    # the per-parameter path: a lazy group (never stacked) on the same rule
    extra = {"lazy": True} if path == "per-parameter" else {}
    opt = EquivariantOptimizer([{"params": params, "rule": rule, **extra}], lr=0.1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items() if k != "nonfinite"} for p in params]
    params[0].grad = torch.randn(10, 4, generator=g)
    params[0].grad[3, 1] = bad
    params[1].grad = torch.randn(10, 4, generator=g)
    opt.step()
    assert torch.equal(params[0].detach(), before[0])
    for k, v in state[0].items():
        assert torch.equal(opt.state[params[0]][k], v), k
    assert not torch.equal(params[1].detach(), before[1])
    if rule == "normuon":
        assert not torch.equal(opt.state[params[1]]["row_second_moment"], state[1]["row_second_moment"])
    assert opt.nonfinite_steps == 1 and opt.last_nonfinite == [opt.param_groups[0]["names"][0]]


@pytest.mark.parametrize(
    "layout,shape", [("heads:3", (12, 5)), ("experts", (3, 8, 4)), ("fused:4,6", (10, 4)), ("col", (4, 9))]
)
@pytest.mark.parametrize("rule", RULES)
def test_layouts_buckets_and_the_per_parameter_path_agree(rule, layout, shape):
    def run(nonfinite):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for _ in range(2)]
        opt = EquivariantOptimizer(
            [{"params": params, "rule": rule, "layout": layout, "nonfinite": nonfinite, "method": "exact"}], lr=0.05
        )
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(shape, generator=g)
            opt.step()
        return params, opt

    a, oa = run("skip")
    b, ob = run("raise")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=1e-6)
        for key, value in ob.state[y].items():
            torch.testing.assert_close(oa.state[x][key], value, rtol=2e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("rule", RULES)
def test_state_dict_round_trip_continues_exactly(rule):
    def make():
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(8, 4, generator=g)) for _ in range(2)]
        return params, EquivariantOptimizer([{"params": params, "rule": rule, "layout": "heads:2"}], lr=0.05)

    grads = [[torch.randn(8, 4, generator=torch.Generator().manual_seed(s + k)) for k in range(2)] for s in range(4)]
    a, oa = make()
    for step in grads[:2]:
        for p, gr in zip(a, step):
            p.grad = gr.clone()
        oa.step()
    b, ob = make()
    with torch.no_grad():
        for x, y in zip(a, b):
            y.copy_(x)
    ob.load_state_dict(oa.state_dict())
    for step in grads[2:]:
        for opt, params in ((oa, a), (ob, b)):
            for p, gr in zip(params, step):
                p.grad = gr.clone()
            opt.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    if rule == "normuon":
        bad = oa.state_dict()
        bad["state"][0]["row_second_moment"] = torch.zeros(5)
        with pytest.raises(ValueError, match="row_second_moment"):
            ob.load_state_dict(bad)


def test_row_moments_keep_the_batch_axes_and_load_the_flat_format():
    """A stack of experts keeps one row of moments per expert, ``(E, m)``, so an expert
    split keeps its experts' rows; a state dict of the earlier flat ``(E * m,)`` format loads
    as that shape, with its values, and one whose size differs is refused by name."""

    def make():
        p = torch.nn.Parameter(torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(1)))
        return p, EquivariantOptimizer([{"params": [p], "rule": "normuon", "layout": "experts:col"}], lr=0.05)

    p, opt = make()
    p.grad = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(2))
    opt.step()
    v = opt.state[p]["row_second_moment"]
    assert v.shape == (3, 4) and bool((v > 0).all())  # col layout: the rows are the 4 stored columns
    flat = opt.state_dict()
    flat["state"][0]["row_second_moment"] = v.reshape(-1).clone()
    q, other = make()
    other.load_state_dict(flat)
    assert torch.equal(other.state[q]["row_second_moment"], v)
    flat["state"][0]["row_second_moment"] = torch.zeros(11)
    with pytest.raises(ValueError, match="row_second_moment"):
        other.load_state_dict(flat)


def test_presets_recipes_and_fields():
    p = torch.nn.Parameter(torch.randn(8, 4))
    opt = eo.NorMuon([p])
    assert opt.param_groups[0]["rule"] == "normuon" and opt.param_groups[0]["beta2"] == 0.95
    with pytest.raises(TypeError, match="normuon"):
        eo.NorMuon([p], rule="spectral")
    recipe = eo.recipes.get_recipe("normuon")
    default = eo.recipes.get_recipe("equiopt:default")
    assert recipe.settings("mlp_in")["rule"] == "normuon"
    for role in ("embedding", "lm_head", "router", "vector"):
        assert recipe.settings(role) == default.settings(role)
    from equiopt.optim.fields import fields_table

    table = fields_table()
    assert "spectral_row" in table and "normuon" in table and "`beta2`" in table
    with pytest.raises(ValueError, match="beta2"):
        EquivariantOptimizer([{"params": [p], "rule": "normuon", "beta2": 1.0}])
