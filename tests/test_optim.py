import copy
import io

import pytest
import reference as ref
import torch

import equiopt as eo
from equiopt.layouts import Col, parse_layout
from equiopt.optim import EquivariantOptimizer, NonFiniteGradientError

EPS = 1e-8


def make_params(*shapes, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.02 * torch.randn(*s, generator=g, dtype=dtype)) for s in shapes]


def grads_for(params, step, seed=100):
    g = torch.Generator().manual_seed(seed + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def run(opt, params, steps, seed=100):
    for k in range(steps):
        for p, gr in zip(params, grads_for(params, k, seed)):
            p.grad = gr.clone()
        opt.step()


def map_ref(rule, D, order="row_then_right", alpha=0.0, centered=False, damping="relative"):
    if rule == "right":
        return ref.right(D, EPS, alpha, centered, damping)
    if rule == "left":
        return ref.left(D, EPS, alpha, centered, damping)
    if rule == "row":
        return ref.row(D, EPS, centered)
    return ref.hybrid(D, order, EPS, alpha, centered, damping)


CASES = [
    ("right", {}, (24, 6)),
    ("right", {"alpha": 1.0, "center": True}, (24, 6)),
    ("left", {"center": True, "alpha": 0.5}, (6, 24)),
    ("row", {}, (24, 6)),
    ("row", {"center": True}, (24, 6)),
    ("hybrid", {"order": "row_then_right", "alpha": 1.0}, (24, 6)),
    ("hybrid", {"order": "right_then_row", "alpha": 1.0, "center": True}, (24, 6)),
    ("hybrid", {"order": "left_then_row", "alpha": 1.0, "center": True}, (6, 24)),
]


@pytest.mark.parametrize("damping", ["relative", "absolute"])
@pytest.mark.parametrize("rule,opts,shape", CASES)
def test_steps_match_hand_written_algorithm(rule, opts, shape, damping):
    """Algorithms 1-2: EMA momentum, the map, decoupled weight decay, exactly."""
    (p,) = make_params(shape)
    lr, beta, wd = 0.05, 0.9, 0.1
    opt = EquivariantOptimizer(
        [p], lr=lr, rule=rule, beta=beta, weight_decay=wd, method="exact", damping=damping, **opts
    )
    W = p.detach().clone()
    M = torch.zeros_like(W)
    for k in range(3):
        (G,) = grads_for([p], k)
        p.grad = G.clone()
        opt.step()
        M = beta * M + (1 - beta) * G
        U = map_ref(
            rule,
            M,
            opts.get("order", "row_then_right"),
            opts.get("alpha", 1.0 if rule == "hybrid" else 0.0),
            opts.get("center", False),
            damping,
        )
        W = (1 - lr * wd) * W - lr * U
        torch.testing.assert_close(p.detach(), W, rtol=1e-10, atol=1e-12)


def test_muon_matches_hand_written_nesterov_and_shape_factor():
    (p,) = make_params((32, 8))
    opt = eo.Muon([p], lr=0.02, beta=0.95, method="exact")
    W, M = p.detach().clone(), torch.zeros(32, 8, dtype=torch.float64)
    for k in range(3):
        (G,) = grads_for([p], k)
        p.grad = G.clone()
        opt.step()
        M = 0.95 * M + 0.05 * G
        D = 0.05 * G + 0.95 * M  # Nesterov look-ahead
        W = W - 0.02 * (32 / 8) ** 0.5 * ref.polar(D)
        torch.testing.assert_close(p.detach(), W, rtol=1e-10, atol=1e-12)


def test_lr_scale_options():
    for kind, factor in [("none", 1.0), ("match_adamw", 0.2 * 32**0.5)]:
        (p,) = make_params((32, 8))
        W = p.detach().clone()
        opt = eo.Muon([p], lr=0.1, method="exact", nesterov=False, beta=0.0, lr_scale=kind)
        (G,) = grads_for([p], 0)
        p.grad = G
        opt.step()
        torch.testing.assert_close(p.detach(), W - 0.1 * factor * ref.polar(G))


def test_sgd_and_adamw_rules():
    p, q = make_params((5, 3), (7,))
    p2, q2 = copy.deepcopy(p), copy.deepcopy(q)
    opt = EquivariantOptimizer(
        [{"params": [p], "rule": "sgd", "beta": 0.0}, {"params": [q], "rule": "adamw", "weight_decay": 0.1}],
        lr=0.01,
        betas=(0.9, 0.95),
    )
    torch_sgd = torch.optim.SGD([p2], lr=0.01)
    torch_adamw = torch.optim.AdamW([q2], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for k in range(4):
        for a, b, gr in zip([p, q], [p2, q2], grads_for([p, q], k)):
            a.grad, b.grad = gr.clone(), gr.clone()
        opt.step()
        torch_sgd.step()
        torch_adamw.step()
        torch.testing.assert_close(p, p2, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(q, q2, rtol=1e-12, atol=1e-14)


def test_layouts_col_applies_map_to_transpose():
    (p,) = make_params((6, 24))  # a down projection (d, d_ff): neurons are columns
    W = p.detach().clone()
    opt = EquivariantOptimizer([p], lr=0.1, rule="row", beta=0.0, layout="col", method="exact")
    (G,) = grads_for([p], 0)
    p.grad = G
    opt.step()
    torch.testing.assert_close(p.detach(), W - 0.1 * ref.row(G.T, EPS).T)


def test_per_parameter_layouts_and_batching_across_params(monkeypatch):
    """Same-shaped work from different parameters and groups is mapped in one call."""
    from equiopt.optim import distribute as engine

    calls = []
    real = engine.factored_map

    def spy(key, eta, D, **kwargs):
        calls.append(tuple(D.shape))
        return real(key, eta, D, **kwargs)

    monkeypatch.setattr(engine, "factored_map", spy)
    up, down, other = make_params((16, 4), (4, 16), (16, 4), dtype=torch.float32)
    opt = EquivariantOptimizer(
        [{"params": [up, down], "layouts": ["row", Col()], "lr": 0.1}, {"params": [other], "lr": 0.2}],
        rule="right",
        beta=0.0,
    )
    W = [t.detach().clone() for t in (up, down, other)]
    G = grads_for([up, down, other], 0)
    for t, g in zip((up, down, other), G):
        t.grad = g.clone()
    opt.step()
    assert calls == [(3, 16, 4)]
    for t, w, g, lr, transpose in zip((up, down, other), W, G, (0.1, 0.1, 0.2), (False, True, False)):
        d = g.T if transpose else g
        u = eo.maps.right_spectral(d)
        torch.testing.assert_close(t.detach(), w - lr * (u.T if transpose else u), rtol=1e-5, atol=1e-6)


def test_expert_batch_equals_loop_over_experts():
    experts = make_params((4, 12, 6), dtype=torch.float32)[0]
    singles = [torch.nn.Parameter(experts.detach()[e].clone()) for e in range(4)]
    opt_a = EquivariantOptimizer([experts], lr=0.1, rule="hybrid", layout="experts:row")
    opt_b = EquivariantOptimizer(singles, lr=0.1, rule="hybrid")
    for k in range(2):
        (G,) = grads_for([experts], k)
        experts.grad = G.clone()
        for e, s in enumerate(singles):
            s.grad = G[e].clone()
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(experts.detach(), torch.stack([s.detach() for s in singles]), rtol=1e-5, atol=1e-7)


def test_state_dict_round_trip_is_exact():
    def build():
        ps = make_params((16, 4), (8, 8), (5,), dtype=torch.float32)
        opt = EquivariantOptimizer(
            [
                {"params": ps[:1], "rule": "hybrid", "center": True, "layout": "col"},
                {"params": ps[1:2], "rule": "spectral", "layout": "heads:4"},
                {"params": ps[2:], "rule": "adamw"},
            ],
            lr=0.01,
        )
        return ps, opt

    ps, opt = build()
    run(opt, ps, 3)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in ps], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # plain data only: layouts are saved as specs
    ps2, opt2 = build()
    with torch.no_grad():
        for a, b in zip(ps2, saved["params"]):
            a.copy_(b)
    opt2.load_state_dict(saved["opt"])
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        for key in a:
            assert torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype
    assert opt2.param_groups[1]["layouts"] == opt.param_groups[1]["layouts"]
    run(opt, ps, 2, seed=7)
    run(opt2, ps2, 2, seed=7)
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


def test_bfloat16_params_keep_float32_state_through_round_trip():
    (p,) = make_params((16, 8), dtype=torch.bfloat16)
    opt = eo.RowNormM([p], lr=0.01)
    run(opt, [p], 2)
    assert p.dtype == torch.bfloat16 and opt.state[p]["momentum_buffer"].dtype == torch.float32
    (q,) = make_params((16, 8), dtype=torch.bfloat16)
    opt2 = eo.RowNormM([q], lr=0.01)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[q]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(opt2.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])


@pytest.mark.parametrize(
    "make_sched",
    [
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10, cycle_momentum=False),
    ],
)
def test_schedulers_drive_the_learning_rate(make_sched):
    (p,) = make_params((8, 4))
    opt = eo.RightPolarGradM([p], lr=0.1, beta=0.0, method="exact")
    sched = make_sched(opt)
    for k in range(3):
        lr = opt.param_groups[0]["lr"]
        W = p.detach().clone()
        (G,) = grads_for([p], k)
        p.grad = G
        opt.step()
        torch.testing.assert_close(p.detach(), W - lr * ref.right(G, EPS, 0.0))
        sched.step()
    sd = sched.state_dict()
    assert "last_epoch" in sd


def test_closure_zero_grad_and_add_param_group():
    model = torch.nn.Linear(8, 4, bias=False)
    opt = eo.Muon(model.parameters(), lr=0.01)
    x = torch.randn(16, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss)
    opt.zero_grad()
    assert model.weight.grad is None
    bias = torch.nn.Parameter(torch.zeros(4))
    opt.add_param_group({"params": [bias], "rule": "adamw", "lr": 1e-3})
    assert opt.param_groups[-1]["rule"] == "adamw" and opt.param_groups[-1]["betas"] == (0.9, 0.95)
    with pytest.raises(ValueError, match="needs a matrix"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "rule": "row", "names": ["ln.weight"]})


def test_bad_inputs_name_the_parameter():
    vec = torch.nn.Parameter(torch.zeros(7))
    with pytest.raises(ValueError, match="norm.weight.*needs a matrix"):
        EquivariantOptimizer([{"params": [vec], "names": ["norm.weight"]}], rule="spectral")
    mat = torch.nn.Parameter(torch.zeros(10, 6))
    with pytest.raises(ValueError, match="q_proj"):
        EquivariantOptimizer([{"params": [mat], "names": ["q_proj"], "layout": "heads:4"}], rule="spectral")
    with pytest.raises(ValueError, match="unknown rule 'lion'"):
        EquivariantOptimizer([mat], rule="lion")
    with pytest.raises(ValueError, match="unknown method 'svd'"):
        EquivariantOptimizer([mat], rule="right", method="svd")
    with pytest.raises(ValueError, match="beta"):
        EquivariantOptimizer([mat], rule="row", beta=1.0)
    with pytest.raises(ValueError, match="order"):
        EquivariantOptimizer([mat], rule="hybrid", order="sideways")
    with pytest.raises(ValueError, match="layouts"):
        EquivariantOptimizer([{"params": [mat], "layouts": ["row", "col"]}], rule="row")


def test_nonfinite_gradient_is_skipped_and_counted():
    p, q = make_params((8, 4), (8, 4), dtype=torch.float32)
    opt = EquivariantOptimizer([{"params": [p, q], "names": ["a", "b"]}], rule="hybrid", lr=0.1)
    run(opt, [p, q], 1)
    before_p, before_state = p.detach().clone(), opt.state[p]["momentum_buffer"].clone()
    before_q = q.detach().clone()
    p.grad = torch.full_like(p, float("nan"))
    q.grad = torch.randn_like(q)
    opt.step()
    assert torch.equal(p.detach(), before_p) and torch.equal(opt.state[p]["momentum_buffer"], before_state)
    assert not torch.equal(q.detach(), before_q)
    assert opt.nonfinite_steps == 1 and opt.last_nonfinite == ["a"]
    fresh = EquivariantOptimizer([{"params": [p, q], "names": ["a", "b"]}], rule="hybrid", lr=0.1)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.nonfinite_steps == 1  # the counters live in per-parameter state
    strict = EquivariantOptimizer([{"params": [p], "names": ["a"]}], rule="row", nonfinite="raise")
    p.grad = torch.full_like(p, float("inf"))
    with pytest.raises(NonFiniteGradientError, match="'a'"):
        strict.step()
    assert torch.equal(p.detach(), before_p)


def test_zero_momentum_rows_get_zero_update():
    emb = torch.nn.Embedding(50, 8)
    W = emb.weight.detach().clone()
    for rule in ["row", "right", "hybrid"]:
        with torch.no_grad():
            emb.weight.copy_(W)
        opt = EquivariantOptimizer(emb.parameters(), rule=rule, lr=0.1)
        emb(torch.tensor([[1, 2, 3, 2]])).sum().backward()
        opt.step()
        opt.zero_grad()
        moved = (emb.weight.detach() - W).abs().sum(-1) > 0
        assert torch.isfinite(emb.weight).all()
        assert moved[[1, 2, 3]].all() and not moved[4:].any() and not moved[0]


def test_eager_state_creates_every_key():
    p, v = make_params((8, 4), (4,))
    opt = EquivariantOptimizer([{"params": [p]}, {"params": [v], "rule": "adamw"}], eager_state=True)
    sd = opt.state_dict()["state"]
    assert set(sd[0]) == {"momentum_buffer", "nonfinite"} and set(sd[1]) == {
        "step",
        "exp_avg",
        "exp_avg_sq",
        "nonfinite",
    }


def test_presets_fix_their_rule():
    (p,) = make_params((8, 4))
    for cls, rule in [
        (eo.Muon, "spectral"),
        (eo.RightPolarGradM, "right"),
        (eo.LeftPolarGradM, "left"),
        (eo.RowNormM, "row"),
        (eo.HybridPolarGradM, "hybrid"),
    ]:
        opt = cls([p])
        assert opt.param_groups[0]["rule"] == rule and type(opt).__name__ == cls.__name__
        with pytest.raises(TypeError, match="fixes rule"):
            cls([p], rule="adamw")


def test_layout_spec_strings_are_accepted():
    assert parse_layout("col") == Col()
