"""torch.optim conformance of :class:`EquivariantOptimizer`, for every rule with several
layouts and centring: the checks PyTorch's own optimizer tests make (state_dict round
trips, ``weights_only`` loading, param groups, ``zero_grad``, closures, parameters
without gradients, hooks, every LR scheduler, parameter dtypes), and agreement with
``torch.optim.Muon``."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import equiopt as eo
from equiopt.layouts import parse_layout
from equiopt.linalg import bfloat16_products, polar
from equiopt.optim import EquivariantOptimizer

pytestmark = pytest.mark.usefixtures("one_thread")  # small steps: one thread beats a loaded pair

# One matrix per layout (spec -> stored shape); the map runs on its work matrices.
MATRICES = {"row": (12, 6), "col": (6, 12), "heads:4": (16, 8), "experts:row": (3, 10, 6)}

# Every rule, with centring, orders, scales and solvers a user would pick.
CASES = {
    "spectral": {"rule": "spectral"},
    "spectral-ns-torch": {
        "rule": "spectral",
        "method": "newton_schulz_torch",
        "polar_dtype": torch.float32,
        "lr_scale": "match_adamw",
    },
    "right": {"rule": "right"},
    "right-centred-rms": {"rule": "right", "center": True, "scale": "rms", "alpha": 1.0},
    "left-centred": {"rule": "left", "center": True, "alpha": 0.5, "method": "exact"},
    "row": {"rule": "row"},
    "row-centred": {"rule": "row", "center": True},
    "hybrid": {"rule": "hybrid"},
    "hybrid-right_then_row-centred": {"rule": "hybrid", "order": "right_then_row", "center": True},
    "hybrid-left_then_row-centred": {"rule": "hybrid", "order": "left_then_row", "center": True},
    "adamw": {"rule": "adamw"},
    "sgd-nesterov": {"rule": "sgd", "nesterov": True, "beta": 0.9},
}
MATRIX_CASES = [c for c in CASES if CASES[c]["rule"] not in ("adamw", "sgd")]


def build(
    case: str | list[str],
    dtype=torch.float32,
    seed: int = 0,
    scale: float = 0.5,
    weight_decay: float = 0.01,
    lr: float = 0.01,
):
    """Parameters and optimizer: a group per case (a matrix of every layout, or for the
    element-wise rules two matrices; learning rates differ between groups) and a last,
    AdamW group holding a vector."""
    gen = torch.Generator().manual_seed(seed)

    def param(shape):
        return torch.nn.Parameter((scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype))

    params, groups = [], []
    for k, name in enumerate([case] if isinstance(case, str) else case):
        settings = CASES[name]
        if settings["rule"] in ("adamw", "sgd"):
            mats = [param(MATRICES["row"]), param(MATRICES["experts:row"])]
            group = {"params": mats}
        else:  # Layout objects, not specs: state_dict must turn them into plain data
            mats = [param(shape) for shape in MATRICES.values()]
            group = {"params": mats, "layouts": [parse_layout(spec) for spec in MATRICES]}
        groups.append({**group, **settings, "lr": lr * (1 + 0.1 * k), "weight_decay": weight_decay})
        params += mats
    vec = param((5,))
    groups.append({"params": [vec], "rule": "adamw", "lr": 0.3 * lr, "weight_decay": weight_decay})
    return params + [vec], EquivariantOptimizer(groups)


def gradients(params, step: int, seed: int = 100):
    """Reproducible gradients for ``step`` (drawn in float64, rounded to each dtype)."""
    gen = torch.Generator().manual_seed(seed + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params]


def run(opt, params, steps: int, first: int = 0, seed: int = 100) -> None:
    for k in range(first, first + steps):
        for p, g in zip(params, gradients(params, k, seed)):
            p.grad = g
        opt.step()


def state_tensors(opt) -> list[tuple[int, str, torch.Tensor]]:
    params = [p for g in opt.param_groups for p in g["params"]]
    return [(i, key, value) for i, p in enumerate(params) for key, value in sorted(opt.state[p].items())]


def assert_same_state(a, b) -> None:
    sa, sb = state_tensors(a), state_tensors(b)
    assert [(i, k) for i, k, _ in sa] == [(i, k) for i, k, _ in sb]
    for (i, key, x), (_, _, y) in zip(sa, sb):
        assert x.dtype == y.dtype and torch.equal(x, y), (i, key)


def twin(params, dtype=None):
    """Fresh leaf copies of ``params`` (same values; optionally another dtype)."""
    return [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]


# --------------------------------------------------------------------- state_dict
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_round_trip_gives_bit_identical_steps(case, dtype):
    ps, opt = build(case, dtype)
    run(opt, ps, 3)
    sd = opt.state_dict()
    before = copy.deepcopy(sd)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in ps], "optimizer": sd}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # plain data only (layouts as specs, dtypes, tuples)
    untouched = copy.deepcopy(saved["optimizer"])

    ps2, opt2 = build(case, dtype, seed=1)  # other weights: everything must come from the checkpoint
    with torch.no_grad():
        for p, q in zip(ps2, saved["params"]):
            p.copy_(q)
    opt2.load_state_dict(saved["optimizer"])
    # loading neither changes its argument nor loses anything: the state_dicts are equal
    assert_dicts_equal(saved["optimizer"], untouched)
    assert_dicts_equal(opt2.state_dict(), before)
    assert [g["layouts"] for g in opt2.param_groups] == [g["layouts"] for g in opt.param_groups]

    # loaded straight from memory (no serialisation), sharing no tensor with the source
    ps3, opt3 = build(case, dtype, seed=2)
    with torch.no_grad():
        for p, q in zip(ps3, ps):
            p.copy_(q)
    opt3.load_state_dict(opt.state_dict())
    run(opt3, ps3, 1, first=3)
    assert_dicts_equal(opt.state_dict(), before)  # stepping the copy left the source alone

    run(opt, ps, 3, first=3)
    run(opt2, ps2, 3, first=3)
    for p, q in zip(ps, ps2):
        assert p.dtype == q.dtype and torch.equal(p, q)
    assert_same_state(opt, opt2)


def assert_dicts_equal(a, b, path="state_dict") -> None:
    assert type(a) is type(b) or (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))), path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_dicts_equal(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for k, (x, y) in enumerate(zip(a, b)):
            assert_dicts_equal(x, y, f"{path}[{k}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("case", ["hybrid-right_then_row-centred", "adamw", "spectral"])
def test_state_dict_of_an_older_version_without_newer_group_keys_loads_with_defaults(case):
    """A checkpoint written before a group setting existed (torch's test_can_load_older_state_dict):
    the missing keys take the optimizer's defaults and the run goes on as with them."""
    ps, opt = build(case)
    run(opt, ps, 2)
    sd = opt.state_dict()
    older = copy.deepcopy(sd)
    for group in older["param_groups"]:
        for key in ("lazy", "nonfinite", "scale", "names", "polar_dtype"):
            group.pop(key, None)
    ps2, opt2 = build(case, seed=1)
    with torch.no_grad():
        for p, q in zip(ps2, ps):
            p.copy_(q)
    opt2.load_state_dict(older)
    assert all(g["lazy"] is False and g["nonfinite"] == "skip" for g in opt2.param_groups)
    run(opt, ps, 2, first=2)
    run(opt2, ps2, 2, first=2)
    for p, q in zip(ps, ps2):
        assert torch.equal(p, q)


def test_load_state_dict_refuses_another_structure():
    ps, opt = build("row")
    run(opt, ps, 1)
    other = EquivariantOptimizer([{"params": ps[:2], "rule": "row"}, {"params": ps[2:], "rule": "adamw"}])
    with pytest.raises(ValueError, match="parameter group|size"):
        other.load_state_dict(opt.state_dict())


def test_named_parameters_give_names_and_round_trip():
    """``torch.optim`` accepts ``named_parameters()``; the names reach the messages and the state_dict."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))
    try:
        opt = EquivariantOptimizer(model.named_parameters(), rule="adamw", lr=1e-3)
    except TypeError:
        pytest.skip("this torch's optimizers take no named parameters")
    assert opt.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    fresh = EquivariantOptimizer(model.named_parameters(), rule="adamw", lr=1e-3)
    fresh.load_state_dict(sd)
    assert_same_state(opt, fresh)
    with pytest.raises(ValueError, match=r"'0\.bias'.*needs a matrix"):
        EquivariantOptimizer(model.named_parameters(), rule="row")


# --------------------------------------------------------------- param groups
@pytest.mark.parametrize("case", list(CASES))
def test_add_param_group_fills_defaults_and_steps_like_a_fresh_optimizer(case):
    ps, opt = build(case)
    run(opt, ps, 2)
    extra = [torch.nn.Parameter(torch.randn(9, 4, dtype=torch.float32)), torch.nn.Parameter(torch.randn(4, 9))]
    new = {"params": extra, "rule": CASES[case]["rule"], "lr": 0.02}
    reference = EquivariantOptimizer([{**new, "params": twin(extra)}])
    opt.add_param_group(new)
    group = opt.param_groups[-1]
    assert set(group) >= set(opt.defaults) and group["lr"] == 0.02  # every default filled in
    assert group["beta"] == opt.defaults["beta"] and group["layouts"] == [parse_layout("row")] * 2
    assert not any(p in opt.state for p in extra)  # no state before its first step
    for k in range(2, 5):
        grads = gradients(ps + extra, k)
        for p, g in zip(ps + extra, grads):
            p.grad = g
        for p, g in zip(reference.param_groups[0]["params"], grads[len(ps) :]):
            p.grad = g.clone()
        opt.step()
        reference.step()
    for p, q in zip(extra, reference.param_groups[0]["params"]):
        assert torch.equal(p, q)
    # and the grown optimizer round-trips through a state_dict
    again = EquivariantOptimizer([dict(g) for g in opt.param_groups])
    again.load_state_dict(opt.state_dict())
    assert_same_state(opt, again)


def test_add_param_group_refuses_bad_groups_by_name():
    ps, opt = build("row")
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [ps[0]]})
    with pytest.raises(ValueError, match=r"param_groups\[2\].*unknown rule 'lion'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], "rule": "lion"})
    with pytest.raises(ValueError, match=r"param_groups\[2\].*beta"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], "beta": 1.5})
    with pytest.raises(ValueError, match="'router'.*complex"):
        opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))], "names": ["router"]}
        )
    with pytest.raises(ValueError, match="'step_count'.*floating"):
        EquivariantOptimizer([{"params": [torch.zeros(3, 3, dtype=torch.int64)], "names": ["step_count"]}])
    eager = EquivariantOptimizer([ps[0]], rule="row", eager_state=True)
    eager.add_param_group({"params": [ps[4]], "rule": "adamw"})
    assert set(eager.state[ps[4]]) == {"step", "exp_avg", "exp_avg_sq", "nonfinite"}


def test_groups_keep_their_own_learning_rates_and_decay():
    """Two groups of one rule with different lr and weight decay step as two optimizers."""
    a, b = (torch.nn.Parameter(torch.randn(10, 6, dtype=torch.float64)) for _ in range(2))
    a2, b2 = twin([a, b])
    opt = EquivariantOptimizer(
        [{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.01, "weight_decay": 0.5}], rule="hybrid", method="exact"
    )
    one = EquivariantOptimizer([a2], rule="hybrid", method="exact", lr=0.1)
    two = EquivariantOptimizer([b2], rule="hybrid", method="exact", lr=0.01, weight_decay=0.5)
    for k in range(3):
        for p, q, g in zip((a, b), (a2, b2), gradients([a, b], k)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        one.step()
        two.step()
    torch.testing.assert_close(a, a2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(b, b2, rtol=1e-12, atol=1e-14)


# ------------------------------------------------- zero_grad, closure, missing grads
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    ps, opt = build("hybrid", torch.bfloat16)
    run(opt, ps, 1)
    opt.zero_grad(set_to_none=set_to_none)
    for p in ps:
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad.dtype == p.dtype and not p.grad.any()
    before = [p.detach().clone() for p in ps]
    state = copy.deepcopy(opt.state_dict())
    if set_to_none:  # no gradient at all: the step changes nothing and returns None
        assert opt.step() is None
        assert all(torch.equal(p, b) for p, b in zip(ps, before))
        assert_dicts_equal(opt.state_dict(), state)


@pytest.mark.parametrize("case", list(CASES))
def test_step_with_closure_reevaluates_once_under_grad_and_returns_the_loss(case):
    ps, opt = build(case)
    ps2, opt2 = build(case)
    targets = [torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) for p in ps]
    calls = []

    def loss_of(params):
        return sum(((p - t) ** 2).sum() for p, t in zip(params, targets))

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = loss_of(ps)
        loss.backward()
        return loss

    for _ in range(3):
        loss = opt.step(closure)
        opt2.zero_grad()
        expected = loss_of(ps2)
        expected.backward()
        assert opt2.step() is None
        assert torch.is_tensor(loss) and torch.equal(loss.detach(), expected.detach())
    assert calls == [True, True, True]
    for p, q in zip(ps, ps2):
        assert torch.equal(p, q)
    assert loss_of(ps) < loss_of(build(case)[0])  # three steps downhill


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_without_gradients_get_no_state_and_stay_put(case):
    ps, opt = build(case, weight_decay=0.1)
    idle = {0, len(ps) - 1}  # a matrix of the first group and the vector of the second
    before = [p.detach().clone() for p in ps]
    for k in range(2):
        for i, (p, g) in enumerate(zip(ps, gradients(ps, k))):
            p.grad = None if i in idle else g
        opt.step()
    for i, (p, b) in enumerate(zip(ps, before)):
        assert (p not in opt.state) == (i in idle), i
        assert torch.equal(p, b) == (i in idle), i  # no decay either
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [i for i in range(len(ps)) if i not in idle]
    ps2, opt2 = build(case, weight_decay=0.1)
    with torch.no_grad():
        for p, q in zip(ps2, ps):
            p.copy_(q)
    opt2.load_state_dict(sd)
    assert not any(ps2[i] in opt2.state for i in idle)
    run(opt, ps, 2, first=2)  # now every parameter has a gradient: the idle ones start fresh
    run(opt2, ps2, 2, first=2)
    for p, q in zip(ps, ps2):
        assert torch.equal(p, q)
    assert all(p in opt.state for p in ps)


def test_step_hooks_state_dict_hooks_repr_and_deepcopy():
    ps, opt = build("hybrid")
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd") or sd)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load"))
    run(opt, ps, 1)
    assert calls == ["pre", "post"]
    opt.load_state_dict(opt.state_dict())
    assert calls[2:] == ["sd", "load"]
    assert "rule: hybrid" in repr(opt)
    copied = copy.deepcopy(opt)  # an independent optimizer over copied parameters
    mine = [p for g in copied.param_groups for p in g["params"]]
    run(copied, mine, 1, first=1)
    run(opt, ps, 1, first=1)
    for p, q in zip(ps, mine):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()
    assert_same_state(opt, copied)


def test_tensor_learning_rate_steps_like_a_float_one():
    ps, opt = build("spectral", torch.float64)
    ps2, opt2 = build("spectral", torch.float64)
    for g in opt2.param_groups:
        g["lr"] = torch.tensor(g["lr"], dtype=torch.float64)
    run(opt, ps, 2)
    run(opt2, ps2, 2)
    for p, q in zip(ps, ps2):
        assert torch.equal(p, q)


# ------------------------------------------------------------------ schedulers
S = torch.optim.lr_scheduler
SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda k: 0.8**k),
    "StepLR": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[1, 4], gamma=0.3),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.7),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=5, eta_min=1e-4),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2, eta_min=1e-4),
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=1e-3, max_lr=0.02, step_size_up=2, cycle_momentum=False),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=8, cycle_momentum=False),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.25, total_iters=4),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=3),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=6, power=2.0),
    "SequentialLR": lambda o: S.SequentialLR(
        o, [S.LinearLR(o, start_factor=0.2, total_iters=2), S.ExponentialLR(o, gamma=0.8)], milestones=[2]
    ),
    "ChainedScheduler": lambda o: S.ChainedScheduler(
        [S.ConstantLR(o, factor=0.5, total_iters=3), S.ExponentialLR(o, gamma=0.9)]
    ),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=0),
}


def advance(sched) -> None:
    if isinstance(sched, S.ReduceLROnPlateau):
        sched.step(1.0)  # a loss that never improves: the rate halves every step
    else:
        sched.step()


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_every_scheduler_sets_the_learning_rate_the_step_uses(name):
    """Each step moves the weights by the scheduled rate times the unit-rate update, for
    every rule (one param group per case, each with its own base rate).

    The schedule is taken from the same scheduler driving a ``torch.optim.SGD`` with the
    same groups (torch's own definition of it); the unit-rate update from an identical
    optimizer at lr 1 (without weight decay the update does not depend on the weights).
    """
    ps, opt = build(list(CASES), torch.float64, weight_decay=0.0)
    unit_ps, unit = build(list(CASES), torch.float64, weight_decay=0.0)
    for g in unit.param_groups:
        g["lr"] = 1.0
    sgd = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": g["lr"]} for g in opt.param_groups])
    sched, reference = SCHEDULERS[name](opt), SCHEDULERS[name](sgd)
    owner = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    cases = list(CASES) + ["vector"]
    seen = []
    for k in range(7):
        lrs = [g["lr"] for g in sgd.param_groups]
        seen.append(tuple(lrs))
        assert [g["lr"] for g in opt.param_groups] == lrs
        before, unit_before = [p.detach().clone() for p in ps], [p.detach().clone() for p in unit_ps]
        for p, q, g in zip(ps, unit_ps, gradients(ps, k)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        unit.step()
        sgd.step()
        for p, q, b, ub in zip(ps, unit_ps, before, unit_before):
            i = owner[id(p)]
            torch.testing.assert_close(
                p - b, lrs[i] * (q - ub), rtol=1e-9, atol=1e-15, msg=lambda m: f"{cases[i]}, step {k}: {m}"
            )
        advance(sched)
        advance(reference)
    assert len(set(seen)) > 1  # the schedule did change the rate


def test_scheduler_state_round_trips_with_the_optimizer():
    ps, opt = build("row")
    sched = S.OneCycleLR(opt, max_lr=0.05, total_steps=10, cycle_momentum=False)
    for k in range(3):
        run(opt, ps, 1, first=k)
        sched.step()
    ps2, opt2 = build("row", seed=1)
    with torch.no_grad():
        for p, q in zip(ps2, ps):
            p.copy_(q)
    sched2 = S.OneCycleLR(opt2, max_lr=0.05, total_steps=10, cycle_momentum=False)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    for k in range(3, 6):
        run(opt, ps, 1, first=k)
        run(opt2, ps2, 1, first=k)
        sched.step()
        sched2.step()
        assert sched.get_last_lr() == sched2.get_last_lr()
    for p, q in zip(ps, ps2):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------- dtypes
# Rounding-level agreement with float64 after three steps (relative, Frobenius), for
# weights and gradients of each dtype (the float64 run starts from the same rounded values).
DTYPE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_low_precision_parameters_step_like_float64(case, dtype):
    ps, opt = build(case, dtype, scale=0.05)
    ref = twin(ps, torch.float64)
    settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    ref_opt = EquivariantOptimizer(
        [{**s, "params": ref[: len(ps) - 1] if i == 0 else ref[-1:]} for i, s in enumerate(settings)]
    )
    start = [p.detach().double().clone() for p in ps]
    for k in range(3):
        grads = gradients(ps, k)
        for p, q, g in zip(ps, ref, grads):
            p.grad, q.grad = g, g.double()
        opt.step()
        ref_opt.step()
    for p, q, s in zip(ps, ref, start):
        assert p.dtype == dtype and torch.isfinite(p).all()
        err = ((p.detach().double() - s) - (q.detach() - s)).norm() / (q.detach() - s).norm()
        assert err < DTYPE_TOLERANCE[dtype], (tuple(p.shape), float(err))
    for p, q in zip(ps, ref):
        for key, value in opt.state[p].items():
            assert torch.isfinite(value).all()
            if key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
                assert value.dtype == torch.float32 and ref_opt.state[q][key].dtype == torch.float64


def test_parameters_of_several_dtypes_in_one_group_step_as_alone():
    dtypes = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter((0.05 * torch.randn(12, 6, generator=gen)).to(d)) for d in dtypes]
    alone = twin(ps)
    start = [p.detach().double().clone() for p in ps]
    opt = EquivariantOptimizer(ps, rule="hybrid", lr=0.01)
    opts = [EquivariantOptimizer([p], rule="hybrid", lr=0.01) for p in alone]
    for k in range(2):
        for p, q, g in zip(ps, alone, gradients(ps, k)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        for o in opts:
            o.step()
    for p, q, s, d in zip(ps, alone, start, dtypes):
        assert p.dtype == d
        err = (p.detach().double() - q.detach().double()).norm() / (q.detach().double() - s).norm()
        assert err < {torch.float64: 1e-12}.get(d, DTYPE_TOLERANCE.get(d)), (d, float(err))


# ----------------------------------------------------------- torch.optim.Muon
muon_required = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")

# torch's adjust_lr_fn and the lr_scale of the spectral rule that computes the same factor
ADJUST_LR = {None: "spectral", "original": "spectral", "match_rms_adamw": "match_adamw"}


@muon_required
@pytest.mark.parametrize("shape", [(48, 24), (24, 48)])
@pytest.mark.parametrize(
    "adjust_lr_fn,weight_decay", [(None, 0.0), ("original", 0.0), ("match_rms_adamw", 0.0), ("original", 0.1)]
)
def test_newton_schulz_torch_agrees_with_torch_muon(shape, adjust_lr_fn, weight_decay):
    """``method="newton_schulz_torch"`` with the matching ``lr_scale`` is torch.optim.Muon."""
    gen = torch.Generator().manual_seed(0)
    w0 = 0.02 * torch.randn(shape, generator=gen)
    ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = eo.Muon(
        [ours],
        lr=0.02,
        beta=0.95,
        method="newton_schulz_torch",
        steps=5,
        lr_scale=ADJUST_LR[adjust_lr_fn],
        weight_decay=weight_decay,
    )
    ref = torch.optim.Muon(
        [theirs],
        lr=0.02,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        adjust_lr_fn=adjust_lr_fn,
        weight_decay=weight_decay,
    )
    for _ in range(10):
        g = torch.randn(shape, generator=gen)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        with bfloat16_products(torch.device("cpu")):  # the products as equiopt runs them on this CPU
            ref.step()
    moved = (theirs.detach() - w0).norm()
    assert (ours.detach() - theirs.detach()).norm() <= 1e-5 * moved
    torch.testing.assert_close(
        opt.state[ours]["momentum_buffer"], ref.state[theirs]["momentum_buffer"], rtol=1e-6, atol=1e-9
    )


def test_newton_schulz_torch_normalises_without_a_margin():
    """The torch variant is invariant to the input's scale (a power of two: exact) and maps
    zero to zero; Muon's own variant shrinks its input by the 1 % margin first, which its
    non-convergent quintic turns into a different output."""
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(3, 20, 12, generator=gen)
    torch_variant = polar(X, method="newton_schulz_torch")
    assert torch.equal(polar(1024.0 * X, method="newton_schulz_torch"), torch_variant)
    assert torch.equal(polar(torch.zeros(20, 12), method="newton_schulz_torch"), torch.zeros(20, 12))
    for matrix in range(3):  # batched matrices are normalised one by one
        assert torch.equal(polar(X[matrix], method="newton_schulz_torch"), torch_variant[matrix])
    ours = polar(X, method="newton_schulz")
    assert (ours - torch_variant).norm() > 1e-3 * torch_variant.norm()
    s = torch.linalg.svdvals(torch_variant.double())
    assert s.min() > 0.5 and s.max() < 1.5  # Muon's band of singular values
