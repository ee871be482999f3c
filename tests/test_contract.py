"""torch.optim's contract where equiopt used to differ: tensor learning rates, loads that are
all or nothing, and older state-dict formats."""

import copy
import io

import pytest
import torch

from equiopt.optim import EquivariantOptimizer

RULES = ["spectral", "row", "hybrid", "adamw"]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 8, generator=g)) for _ in range(2)] + [
        torch.nn.Parameter(torch.randn(8, generator=g))
    ]


def _opt(params, rule, lr):
    return EquivariantOptimizer([{"params": params[:2], "rule": rule}, {"params": params[2:], "rule": "adamw"}], lr=lr)


def _train(params, opt, steps=3, seed=1):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        sched.step()


@pytest.mark.parametrize("rule", RULES)
def test_a_tensor_lr_steps_and_schedules_as_a_float_lr(rule):
    a, b = _params(), _params()
    ta, tb = _opt(a, rule, torch.tensor(0.01)), _opt(b, rule, 0.01)
    _train(a, ta)
    _train(b, tb)
    assert torch.is_tensor(ta.param_groups[0]["lr"])
    for x, y in zip(a, b):  # a float32 lr against a float one: equal to float32 rounding
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_a_tensor_lr_round_trips_through_a_state_dict():
    params = _params()
    opt = _opt(params, "spectral", torch.tensor(0.01))
    _train(params, opt)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin_params = [copy.deepcopy(p) for p in params]
    twin = _opt(twin_params, "spectral", torch.tensor(0.5))
    twin.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(twin.param_groups[0]["lr"], opt.param_groups[0]["lr"])
    _train(params, opt, seed=2)
    _train(twin_params, twin, seed=2)
    for x, y in zip(params, twin_params):
        assert torch.equal(x, y)


def test_a_tensor_lr_of_several_elements_is_refused_as_torch_refuses_it():
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        EquivariantOptimizer(_params()[:1], lr=torch.tensor([0.1, 0.2]))


def _snapshot(opt):
    return copy.deepcopy(opt.state_dict())


def _same(a, b):
    assert [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]
    ]
    for i, st in a["state"].items():
        for key, value in st.items():
            assert torch.equal(value, b["state"][i][key]), (i, key)


@pytest.mark.parametrize(
    "damage",
    [
        lambda sd: sd["param_groups"][0].update(layouts=["heads:5", "heads:5"]),  # does not fit 16 rows
        lambda sd: sd["param_groups"][1].update(betas=(1.5, 0.9)),
        lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(3, 3)),
        lambda sd: sd["param_groups"][0].update(method="unknown"),
    ],
    ids=["layout", "betas", "state shape", "method"],
)
def test_a_refused_load_leaves_the_optimizer_as_it_was(damage):
    params = _params()
    opt = _opt(params, "spectral", 0.01)
    _train(params, opt)
    before = _snapshot(opt)
    bad = copy.deepcopy(opt.state_dict())
    damage(bad)
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    _same(_snapshot(opt), before)
    _train(params, opt, seed=2)  # and it still steps


def test_an_older_adamw_step_saved_as_a_number_loads_and_steps():
    params = _params()
    opt = _opt(params, "row", 0.01)
    _train(params, opt)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        if "step" in st:
            st["step"] = int(st["step"].item())
    twin_params = [copy.deepcopy(p) for p in params]
    twin = _opt(twin_params, "row", 0.01)
    twin.load_state_dict(sd)
    _train(params, opt, seed=2)
    _train(twin_params, twin, seed=2)
    for x, y in zip(params, twin_params):
        assert torch.equal(x, y)


def test_a_warmup_longer_than_the_run_is_shortened_with_a_warning_naming_the_role():
    pytest.importorskip("transformers")
    import equiopt
    from equiopt.opcount import qwen3_structure

    model = qwen3_structure(2, 16)
    with pytest.warns(UserWarning, match=r"role 'vector'.*warm-up of 100 steps does not fit in total_steps=50") as seen:
        opt, sched = equiopt.build_optimizer(model, "paper:qwen3:a-i", total_steps=50)
    assert any("shortened to 5 steps" in str(w.message) for w in seen)
    group = next(g for g in opt.param_groups if g.get("role") == "vector")
    peak = group["lr"]
    for _ in range(50):
        opt.step()  # no gradients: nothing moves, the schedule still runs
        sched.step()
        peak = max(peak, group["lr"])
    assert peak == pytest.approx(group["initial_lr"], rel=1e-9)  # the run reaches its learning rate
