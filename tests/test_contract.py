"""torch.optim's contract where equiopt used to differ: tensor learning rates, loads that are
all or nothing, and older state-dict formats; and the generic checks PyTorch's own optimizer
tests make of every optimizer, for every rule (a matrix of each rule beside a vector of
AdamW): the direction of the steps with and without schedules, contiguous or not, group
learning rates and decay, zero and missing gradients, deterministic state dicts, named and
unnamed state dicts, every kind of hook, deepcopy and pickling, the state's shape, complex
parameters (element-wise rules step them as their real views; matrix rules refuse them as
torch's Muon does), sparse gradients, vectors for matrix rules, and bad inputs.

Closures, ``zero_grad``, parameters without gradients, ``add_param_group``, every LR
scheduler, ``weights_only`` loading and parameter dtypes are checked in
``tests/test_conformance.py``."""

import copy
import io
import pickle
import re
from collections import defaultdict

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from equiopt.optim import EquivariantOptimizer, UnsupportedTensorError

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


# ------------------------------------------------------------ torch's generic checks
ALL_RULES = ["adamw", "sgd", "spectral", "row", "right", "left", "hybrid", "spectral_row", "normuon"]
MATRIX = ["spectral", "row", "right", "left", "hybrid", "spectral_row", "normuon"]
ELEMENTWISE = ["adamw", "sgd"]


def _linear(rule, contiguous=True, seed=0, **settings):
    """torch's test model: ``loss = |W x + b|^2`` with ``W`` (10 x 5) stepped by ``rule`` and
    ``b`` (10) by AdamW; non-contiguous: both are strided views of larger tensors."""
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        w, b = torch.randn(10, 5, generator=g), torch.randn(10, generator=g)
    else:
        w, b = torch.randn(10, 5, 2, generator=g)[..., 0], torch.randn(10, 2, generator=g)[..., 0]
    w, b = torch.nn.Parameter(w), torch.nn.Parameter(b)
    groups = [{"params": [w], "rule": rule, **settings}, {"params": [b], "rule": "adamw"}]
    return w, b, EquivariantOptimizer(groups, lr=1e-2)


def _loss(w, b, seed=5):
    x = torch.randn(5, generator=torch.Generator().manual_seed(seed))
    return (w.mv(x) + b).pow(2).sum()


def _closure(opt, w, b):
    def closure():
        opt.zero_grad()
        loss = _loss(w, b)
        loss.backward()
        return loss

    return closure


def _equal(a, b, path="") -> None:
    """Equal nested state dicts: the same keys, types and values, tensors bit for bit."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _equal(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for k, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}[{k}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("with_schedule", [False, True], ids=["constant", "scheduled"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
@pytest.mark.parametrize("rule", ALL_RULES)
def test_twenty_steps_go_downhill(rule, contiguous, with_schedule):
    w, b, opt = _linear(rule, contiguous)
    assert w.is_contiguous() == contiguous
    schedules = []
    if with_schedule:
        schedules = [
            torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9),
            torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=2),
        ]
    closure = _closure(opt, w, b)
    start = closure().item()
    for _ in range(20):
        loss = opt.step(closure)
        for schedule in schedules:
            plateau = isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau)
            schedule.step(loss.item()) if plateau else schedule.step()
    assert closure().item() < start


@pytest.mark.parametrize("rule", ALL_RULES)
def test_strided_parameters_and_gradients_step_as_contiguous_ones(rule):
    """Bit for bit where the step is element-wise or row-wise; the one-sided and hybrid maps
    add their update with a matrix product accumulated into the weights' view, whose
    summation order follows the memory layout: equal to rounding."""
    w, b, opt = _linear(rule)
    ws, bs, strided = _linear(rule, contiguous=False)
    with torch.no_grad():
        ws.copy_(w)
        bs.copy_(b)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        gw, gb = torch.randn(10, 5, generator=g), torch.randn(10, generator=g)
        w.grad, b.grad = gw.clone(), gb.clone()
        ws.grad = torch.zeros(5, 10).t().copy_(gw)  # a transposed gradient
        bs.grad = torch.zeros(10, 3)[:, 1].copy_(gb)
        opt.step()
        strided.step()
    assert not ws.is_contiguous() and not bs.is_contiguous()
    assert torch.equal(b, bs)
    if rule in ("right", "left", "hybrid"):
        torch.testing.assert_close(ws, w, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(w, ws)
    for p, q in ((w, ws), (b, bs)):
        for key, value in opt.state[p].items():
            torch.testing.assert_close(strided.state[q][key], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", ALL_RULES)
def test_group_learning_rates_and_weight_decay_are_per_group(rule):
    """torch's test_param_groups_lr and _weight_decay: a group at a rate of 1e-28 does not move;
    a group with decay and one without both go downhill."""
    w, b = torch.nn.Parameter(torch.randn(10, 5)), torch.nn.Parameter(torch.randn(10))
    idle = torch.nn.Parameter(torch.randn(2))
    idle_before = idle.detach().clone()
    opt = EquivariantOptimizer(
        [
            {"params": [w], "rule": rule, "lr": 1e-2, "weight_decay": 0.1},
            {"params": [b], "rule": "adamw", "lr": 1e-2, "weight_decay": 0.0},
            {"params": [idle], "rule": "adamw"},
        ],
        lr=1e-28,
    )
    start = _loss(w, b).item()
    for _ in range(20):
        opt.zero_grad()
        _loss(w, b).backward()
        idle.grad = torch.rand_like(idle)
        opt.step()
    assert _loss(w, b).item() < start
    assert torch.equal(idle, idle_before)


@pytest.mark.parametrize("rule", ALL_RULES)
def test_zero_gradients_leave_the_weights_as_they_are(rule):
    p = torch.nn.Parameter(torch.randn(5, 1))
    before = p.detach().clone()
    opt = EquivariantOptimizer([p], rule=rule, lr=1e-3)
    for _ in range(2):
        p.grad = torch.zeros_like(p)
        assert torch.equal(opt.step(lambda: torch.tensor([1.0])), torch.tensor([1.0]))
    assert torch.equal(p, before)
    assert opt.nonfinite_steps == 0 and opt.nonfinite_updates == 0  # a zero update, not a skipped one


@pytest.mark.parametrize("rule", ALL_RULES)
def test_a_step_over_tensors_that_need_no_gradient_changes_nothing(rule):
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
    before = [p.clone() for p in params]
    opt = EquivariantOptimizer(params, rule=rule, weight_decay=0.1)
    assert torch.equal(opt.step(lambda: torch.tensor([1.0])), torch.tensor([1.0]))
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert len(opt.state) == 0


@pytest.mark.parametrize("rule", ALL_RULES)
def test_state_dict_is_deterministic_and_loads_into_a_fresh_optimizer(rule):
    w, b, opt = _linear(rule)
    for _ in range(3):
        opt.step(_closure(opt, w, b))
    with torch.no_grad():
        wc, bc = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    fresh = EquivariantOptimizer([{"params": [wc], "rule": rule}, {"params": [bc], "rule": "adamw"}], lr=0.5)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(3):
        opt.step(_closure(opt, w, b))
        fresh.step(_closure(fresh, wc, bc))
        assert torch.equal(w, wc) and torch.equal(b, bc)
    _equal(opt.state_dict(), fresh.state_dict())  # equal, not identical, parameters: equal state dicts
    fresh.param_groups.extend(fresh.param_groups)  # a repeated group is represented as the same group
    _equal(opt.state_dict()["param_groups"][-1], fresh.state_dict()["param_groups"][-1])


@pytest.mark.parametrize("named_to", [False, True], ids=["to-unnamed", "to-named"])
@pytest.mark.parametrize("named_from", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("rule", ALL_RULES)
def test_named_and_unnamed_state_dicts_load_into_each_other(rule, named_from, named_to):
    model = torch.nn.Linear(5, 4)

    def make(named):
        pair = [("weight", model.weight), ("bias", model.bias)] if named else [model.weight, model.bias]
        return EquivariantOptimizer([{"params": pair[:1], "rule": rule}, {"params": pair[1:], "rule": "adamw"}])

    source = make(named_from)
    model(torch.randn(3, 5)).sum().backward()
    source.step()
    target = make(named_to)
    target.load_state_dict(copy.deepcopy(source.state_dict()))
    model(torch.randn(3, 5)).sum().backward()
    target.step()
    groups = target.state_dict()["param_groups"]
    if named_from or named_to:
        assert [g["param_names"] for g in groups] == [["weight"], ["bias"]]
    # messages name the parameters: by this optimizer's names, else by the saved ones
    expected = "weight" if named_from or named_to else "param_groups[0].params[0]"
    assert target.param_groups[0]["names"] == [expected]


def _set_test_key(opt):
    opt.state["test"] = 1


def _mark_state_dict(opt, sd):
    sd["ran_pre_hook"] = sd["state"].pop("test", None) == 1
    return sd


@pytest.mark.parametrize("rule", ALL_RULES)
def test_state_dict_hooks_run_as_torch_runs_them(rule):
    w, b, opt = _linear(rule)
    opt.step(_closure(opt, w, b))
    opt.register_state_dict_post_hook(_mark_state_dict)
    assert opt.state_dict()["ran_pre_hook"] is False
    opt.register_state_dict_pre_hook(_set_test_key)
    sd = opt.state_dict()
    assert sd["ran_pre_hook"] is True and "test" not in sd["state"]
    # a key in the state that is no parameter's is carried along and steps nothing
    opt.step(_closure(opt, w, b))
    assert opt.nonfinite_steps == 0
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.step(_closure(opt, w, b))


def _lr_002(opt, sd):
    sd["param_groups"][0]["lr"] = 0.002


def _lr_003(opt, sd):
    changed = copy.deepcopy(sd)
    changed["param_groups"][0]["lr"] = 0.003
    return changed


@pytest.mark.parametrize("rule", ALL_RULES)
def test_load_state_dict_hooks_run_once_in_order_and_before_the_checks(rule):
    w, b, opt = _linear(rule)
    opt.step(_closure(opt, w, b))
    sd = opt.state_dict()
    opt.register_load_state_dict_pre_hook(_lr_002)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_pre_hook(_lr_003, prepend=True)  # runs first; the other one wins
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002

    w, b, opt = _linear(rule)
    opt.step(_closure(opt, w, b))
    calls = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("pre") or _lr_003(o, sd))
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("post", o.param_groups[0]["lr"])))
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", ("post", 0.003)]

    # a pre hook may convert a state dict the checks would refuse (an older or foreign format)
    w, b, opt = _linear(rule)
    opt.step(_closure(opt, w, b))
    foreign = copy.deepcopy(opt.state_dict())
    foreign["param_groups"][0]["weight_decay"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[0\], field 'weight_decay'"):
        opt.load_state_dict(foreign)
    opt.register_load_state_dict_pre_hook(_repair)
    opt.load_state_dict(foreign)
    assert opt.param_groups[0]["weight_decay"] == 0.0
    opt.step(_closure(opt, w, b))


def _repair(opt, sd):
    sd["param_groups"][0]["weight_decay"] = 0.0


@pytest.mark.parametrize("rule", ALL_RULES)
def test_step_hooks_local_and_global_run_in_order_and_come_off(rule):
    w, b, opt = _linear(rule)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))])
    calls = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, args, kwargs: calls.append(0)),
        register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append(5)),
        opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(1)),
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append(2)),
    ]
    try:
        opt.step(_closure(opt, w, b))
        other.step()
        opt.step(_closure(opt, w, b))
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [0, 1, 2, 5, 0, 5, 0, 1, 2, 5]
    opt.step(_closure(opt, w, b))
    assert len(calls) == 10


@pytest.mark.parametrize("rule", ALL_RULES)
def test_deepcopy_and_pickle_keep_every_public_attribute_and_step_alike(rule):
    w, b, opt = _linear(rule)
    for _ in range(3):
        opt.step(_closure(opt, w, b))
    public = lambda o: {k for k in vars(o) if not k.startswith("_")}
    copies = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    for other in copies:
        assert public(other) == public(opt)
        ow, ob = (g["params"][0] for g in other.param_groups)
        other.step(_closure(other, ow, ob))
    opt.step(_closure(opt, w, b))
    for other in copies:
        assert all(torch.equal(p, q) for p, q in zip((w, b), (g["params"][0] for g in other.param_groups)))


@pytest.mark.parametrize("rule", ALL_RULES)
def test_every_parameter_stepped_has_state_in_a_defaultdict(rule):
    model = torch.nn.Linear(5, 5)
    opt = EquivariantOptimizer([{"params": [model.weight], "rule": rule}, {"params": [model.bias], "rule": "adamw"}])
    assert isinstance(opt.state, defaultdict)
    model(torch.rand(2, 5)).sum().backward()
    opt.step()
    assert set(opt.state) == {model.weight, model.bias}
    assert all(len(state) > 0 for state in opt.state.values())
    if rule == "adamw":
        step = opt.state[model.weight]["step"]
        assert torch.is_tensor(step) and step.dtype == torch.float32 and step.item() == 1


# ------------------------------------------------------------ what cannot apply
@pytest.mark.parametrize("rule", ELEMENTWISE)
def test_complex_parameters_step_as_their_real_views(rule):
    """torch's test_complex: an optimizer over complex parameters (and a real one beside them)
    steps each as ``torch.view_as_real`` of it would be stepped, bit for bit."""
    g = torch.Generator().manual_seed(0)
    shapes = [((10, 5), torch.complex64), ((10,), torch.complex64), ((10, 5), torch.float32), ((4,), torch.complex128)]
    complex_ps = [torch.nn.Parameter(torch.randn(s, dtype=d, generator=g)) for s, d in shapes]
    real_ps = [
        torch.nn.Parameter((torch.view_as_real(p) if p.is_complex() else p).detach().clone()) for p in complex_ps
    ]
    settings = dict(rule=rule, lr=0.01, weight_decay=0.1, nesterov=True)
    ours, theirs = EquivariantOptimizer(complex_ps, **settings), EquivariantOptimizer(real_ps, **settings)
    for _ in range(3):
        for c, r in zip(complex_ps, real_ps):
            r.grad = torch.randn(r.shape, dtype=r.dtype, generator=g)
            c.grad = torch.view_as_complex(r.grad.clone()) if c.is_complex() else r.grad.clone()
        ours.step()
        theirs.step()
        for c, r in zip(complex_ps, real_ps):
            assert torch.equal(torch.view_as_real(c) if c.is_complex() else c, r)
    state = ours.state[complex_ps[3]]
    assert all(state[k].dtype == torch.complex128 for k in state if k not in ("step", "nonfinite"))
    # and a checkpoint of them round-trips
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    again = EquivariantOptimizer([torch.nn.Parameter(p.detach().clone()) for p in complex_ps], **settings)
    again.load_state_dict(torch.load(buf, weights_only=True))
    _equal(again.state_dict(), ours.state_dict())


@pytest.mark.parametrize("rule", ELEMENTWISE)
def test_a_complex_parameter_steps_as_its_real_and_imaginary_parts(rule):
    """torch's test_complex_2d: a complex vector against its two real parts, through autograd."""
    a = torch.nn.Parameter(torch.randn(2, dtype=torch.complex64, generator=torch.Generator().manual_seed(1)))
    re, im = torch.nn.Parameter(a.real.detach().clone()), torch.nn.Parameter(a.imag.detach().clone())
    one, two = EquivariantOptimizer([a], rule=rule, lr=0.01), EquivariantOptimizer([re, im], rule=rule, lr=0.01)

    def rosenbrock(z):
        x, y = z
        return ((1 - x) ** 2 + 100 * (y - x**2) ** 2).abs()

    for _ in range(5):
        one.zero_grad()
        two.zero_grad()
        rosenbrock(a).backward()
        rosenbrock(torch.complex(re, im)).backward()
        assert torch.equal(a.grad.real, re.grad) and torch.equal(a.grad.imag, im.grad)
        one.step()
        two.step()
        assert torch.equal(a.real, re) and torch.equal(a.imag, im)


@pytest.mark.parametrize("rule", MATRIX)
def test_a_complex_parameter_of_a_matrix_rule_is_refused_as_torch_muon_refuses_it(rule):
    """torch.optim.Muon raises ``RuntimeError("Muon does not support complex parameters")``;
    the matrix rules raise at construction (and when a group is added or a load would give
    a complex parameter such a rule), by rule and name, an error that is both a RuntimeError
    and a ValueError."""
    z = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match=rf"rule '{rule}' does not support complex parameters: parameter 'z'"):
        EquivariantOptimizer([{"params": [z], "rule": rule, "names": ["z"]}])
    opt = EquivariantOptimizer([{"params": [z], "rule": "sgd", "names": ["z"]}])
    with pytest.raises(ValueError, match="does not support complex parameters"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))], "rule": rule})
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["rule"] = rule
    with pytest.raises(UnsupportedTensorError, match="'z'"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["rule"] == "sgd"
    with pytest.raises(ValueError, match="lazy=True needs real parameters"):
        EquivariantOptimizer([z], rule="sgd", lazy=True)


@pytest.mark.parametrize("rule", ALL_RULES)
@pytest.mark.parametrize("which", ["matrix", "vector"])
def test_a_sparse_gradient_is_refused_before_anything_steps(rule, which):
    """torch's optimizers without sparse support raise ``RuntimeError("... does not support
    sparse gradients")`` in the step; here the step checks every gradient first, so the
    refused step changes no weight and no state."""
    w, b, opt = _linear(rule)
    opt.step(_closure(opt, w, b))
    before = copy.deepcopy(opt.state_dict())
    weights = [w.detach().clone(), b.detach().clone()]
    w.grad, b.grad = torch.randn(10, 5), torch.randn(10)
    if which == "matrix":
        w.grad = w.grad.to_sparse()
    else:
        b.grad = b.grad.to_sparse()
    named = rule if which == "matrix" else "adamw"
    where = "param_groups[0].params[0]" if which == "matrix" else "param_groups[1].params[0]"
    pattern = rf"rule '{named}' does not support sparse gradients: parameter '{re.escape(where)}'"
    with pytest.raises(RuntimeError, match=pattern):
        opt.step()
    assert torch.equal(w, weights[0]) and torch.equal(b, weights[1])
    _equal(opt.state_dict(), before)


@pytest.mark.parametrize("rule", MATRIX)
def test_a_vector_for_a_matrix_rule_is_refused_by_name(rule):
    """torch.optim.Muon: ``ValueError("Muon only supports 2D parameters")``; the matrix rules
    take stacks of matrices too, so vectors and scalars are what they refuse."""
    model = torch.nn.Linear(4, 3)
    for shape in [(3,), ()]:
        p = torch.nn.Parameter(torch.randn(shape))
        with pytest.raises(
            ValueError, match=re.escape(f"'bias' has shape {tuple(shape)}: rule '{rule}' needs a matrix")
        ):
            EquivariantOptimizer([{"params": [p], "names": ["bias"], "rule": rule}])
    with pytest.raises(ValueError, match=r"only supports parameters of 2 or more dimensions"):
        EquivariantOptimizer(model.parameters(), rule=rule)


# torch's error inputs, and those of the settings each rule reads: (params or groups, kwargs, error, pattern)
def _p(*shape):
    return torch.nn.Parameter(torch.randn(*shape))


_SHARED = _p(3, 3)
ERROR_INPUTS = {
    "a tensor": (lambda: _p(3, 3), {}, TypeError, "iterable of Tensors or dicts"),
    "a set": (lambda: {_p(3, 3)}, {}, TypeError, "ordered collections"),
    "a set in a group": (lambda: [{"params": {_p(3, 3)}}], {}, TypeError, "ordered collections"),
    "nothing": (lambda: [], {}, ValueError, "empty parameter list"),
    "in two groups": (lambda: [{"params": [_SHARED]}, {"params": [_SHARED]}], {}, ValueError, "more than one"),
    "some names": (lambda: [("a", _p(3, 3)), _p(3, 3)], {}, ValueError, "Some param names are missing"),
    "named and unnamed groups": (
        lambda: [{"params": [("a", _p(3, 3))]}, {"params": [_p(3, 3)]}],
        {},
        ValueError,
        "with/without names",
    ),
    "non-leaf": (lambda: [_p(3, 3) * 2], {}, ValueError, "non-leaf"),
    "integer": (lambda: [torch.zeros(3, 3, dtype=torch.int64)], {}, ValueError, "floating-point"),
    "tensor lr of two": (
        lambda: [_p(3, 3)],
        {"lr": torch.tensor([0.1, 0.2])},
        ValueError,
        "Tensor lr must be 1-element",
    ),
    "maximize": (lambda: [_p(3, 3)], {"maximize": True}, TypeError, "maximize"),
    "foreach": (lambda: [_p(3, 3)], {"foreach": True}, TypeError, "foreach"),
    "fused": (lambda: [_p(3, 3)], {"fused": True}, TypeError, "fused"),
    "differentiable": (lambda: [_p(3, 3)], {"differentiable": True}, TypeError, "differentiable"),
    "capturable": (lambda: [_p(3, 3)], {"capturable": True}, TypeError, "capturable"),
    "maximize in a group": (
        lambda: [{"params": [_p(3, 3)], "maximize": True}],
        {},
        ValueError,
        r"field 'maximize': EquivariantOptimizer does not offer maximize=True",
    ),
    "differentiable in a group": (
        lambda: [{"params": [_p(3, 3)], "differentiable": True}],
        {},
        ValueError,
        r"field 'differentiable'.*not differentiable",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_INPUTS))
def test_bad_inputs_raise_what_torch_raises(case):
    params, kwargs, error, pattern = ERROR_INPUTS[case]
    with pytest.raises(error, match=pattern):
        EquivariantOptimizer(params(), **kwargs)


def test_generators_are_taken_and_duplicates_in_a_group_warn_as_torch_warns():
    ps = [_p(3, 3), _p(4, 2)]
    assert EquivariantOptimizer(p for p in ps).param_groups[0]["params"] == ps
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        EquivariantOptimizer([ps[0], ps[0]])
    # the flags torch's optimizers take, at their off values, change nothing and are kept
    opt = EquivariantOptimizer([{"params": ps, "maximize": False, "differentiable": False, "foreach": None}])
    assert opt.param_groups[0]["maximize"] is False


# each rule's settings out of range, as torch's error inputs have them (negative lr, beta 1, ...)
BAD_SETTINGS = {
    "lr": [-0.1, float("nan"), "0.1"],
    "weight_decay": [-1.0, float("inf")],
    "beta": [1.0, -0.1],
    "betas": [(1.0, 0.0), (0.9, -0.1), (0.9,)],
    "adam_eps": [0.0, -1e-8],
    "eps": [0.0],
    "steps": [0, 1.5],
    "alpha": [1.5],
    "method": ["unknown"],
    "lr_scale": ["arbitrary"],
    "nesterov": ["yes"],
}


@pytest.mark.parametrize("rule", ALL_RULES)
def test_settings_out_of_range_are_refused_naming_the_group_and_setting(rule):
    from equiopt.optim import RULE_FIELDS

    tried = 0
    for field, values in BAD_SETTINGS.items():
        if field not in RULE_FIELDS[rule]:
            continue
        for value in values:
            tried += 1
            with pytest.raises(ValueError, match=rf"param_groups\[1\], field '{field}'"):
                EquivariantOptimizer(
                    [{"params": [_p(3, 3)], "rule": "sgd"}, {"params": [_p(4, 3)], "rule": rule, field: value}]
                )
            with pytest.raises(ValueError, match=rf"field '{field}'"):
                EquivariantOptimizer([_p(3, 3)], rule=rule, **{field: value})
    assert tried >= 5


@pytest.mark.parametrize("rule", ALL_RULES)
def test_swalr_anneals_the_learning_rate_the_step_uses(rule):
    """``torch.optim.swa_utils.SWALR`` drives any optimizer's groups."""
    from torch.optim.swa_utils import SWALR

    w, b, opt = _linear(rule)
    swa = SWALR(opt, swa_lr=0.001, anneal_epochs=3, anneal_strategy="linear")
    rates = []
    for _ in range(5):
        opt.step(_closure(opt, w, b))
        swa.step()
        rates.append(opt.param_groups[0]["lr"])
    assert rates[-1] == pytest.approx(0.001) and rates[0] > rates[-1]


@pytest.mark.parametrize("rule", ["spectral", "hybrid"])
def test_a_tensor_lr_under_compiled_cores_steps_as_eager_without_recompiling(rule):
    """compile=True with a tensor lr and a schedule: the compiled cores read the lr as a
    tensor (no recompilation as it changes) and step as the eager optimizer does."""
    torch._dynamo.reset()
    a, b = _params(), _params()
    compiled = EquivariantOptimizer(
        [{"params": a[:2], "rule": rule}, {"params": a[2:], "rule": "adamw"}],
        lr=torch.tensor(0.01),
        compile=True,
        polar_dtype="float32",
    )
    eager = EquivariantOptimizer(
        [{"params": b[:2], "rule": rule}, {"params": b[2:], "rule": "adamw"}], lr=0.01, polar_dtype="float32"
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        _train(a, compiled, steps=4)
    _train(b, eager, steps=4)
    assert not compiled._compile_failed
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
