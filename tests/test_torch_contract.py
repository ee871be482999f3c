"""torch's contract, checked as torch checks its own optimizers.

Hyperparameters: torch's optimizer tests feed each optimizer the error inputs of
``torch/testing/_internal/common_optimizers.py`` (``get_error_inputs_for_all_optims``,
``optim_error_inputs_func_adam``/``_adamw``/``_sgd``/``_muon``), most with
``params=None``: an optimizer checks its hyperparameters before it reads ``params``.
That module needs torch's test dependencies, so its inputs are copied here (torch 2.13)
and, where torch's own optimizer takes them, checked against the installed torch first.
Every public optimizer class is fed them.

Names: one name concept, torch's ``param_names``; the live groups' ``names`` (the names
messages use) are not saved, and state dicts of an earlier version, which carried
``names``, still load.
"""

import copy

import pytest
import torch

from equiopt.optim import (
    EquivariantOptimizer,
    HybridPolarGradM,
    LeftPolarGradM,
    Muon,
    NorMuon,
    RightPolarGradM,
    RowNormM,
)

CLASSES = [EquivariantOptimizer, Muon, NorMuon, RightPolarGradM, LeftPolarGradM, RowNormM, HybridPolarGradM]


def _p(*shape):
    return torch.nn.Parameter(torch.randn(*shape))


# (torch's optimizer, params, torch's kwargs, error type, torch's regex), as in
# common_optimizers.py; params=None unless a parameter is needed to raise.
TORCH_ERROR_INPUTS = {
    # get_error_inputs_for_all_optims
    "invalid param type": (None, lambda: _p(1, 1), {}, TypeError, "iterable of Tensors or dicts"),
    "duplicates across groups": (
        None,
        lambda: (lambda q: [{"params": q}, {"params": q}])(_p(1, 1)),
        {},
        ValueError,
        "some parameters appear in more than one parameter group",
    ),
    "Tensor lr must be 1-element": (
        torch.optim.AdamW,
        None,
        {"lr": torch.tensor([0.001, 0.001])},
        ValueError,
        "Tensor lr must be 1-element",
    ),
    "params with/without names": (
        None,
        lambda: [("weight", _p(1, 1)), _p(1, 1)],
        {},
        ValueError,
        "all optimizer params should be with/without names. Some param names are missing",
    ),
    "param groups with/without names": (
        None,
        lambda: [{"params": [_p(1, 1)], "lr": 1e-2}, {"params": [("weight", _p(1, 1))]}],
        {},
        ValueError,
        "all optimizer param groups should be with/without names. cannot add param group with names to the optimizer",
    ),
    # optim_error_inputs_func_adam (= _adamw)
    "beta1 should be between 0 and 1": (
        torch.optim.AdamW,
        None,
        {"lr": 1e-2, "betas": (1.0, 0.0)},
        ValueError,
        "Invalid beta parameter at index 0: 1.0",
    ),
    "weight_decay should > 0": (
        torch.optim.AdamW,
        None,
        {"lr": 1e-2, "weight_decay": -1},
        ValueError,
        "Invalid weight_decay value: -1",
    ),
    "betas mixed, float first": (
        torch.optim.AdamW,
        None,
        {"lr": 1e-2, "betas": (0.9, torch.tensor(0.99))},
        ValueError,
        "betas must be either both floats or both Tensors",
    ),
    "betas mixed, tensor first": (
        torch.optim.AdamW,
        None,
        {"lr": 1e-2, "betas": (torch.tensor(0.9), 0.99)},
        ValueError,
        "betas must be either both floats or both Tensors",
    ),
    # optim_error_inputs_func_adamax
    "beta2 should be between 0 and 1": (
        torch.optim.Adamax,
        None,
        {"lr": 1e-2, "betas": (0.0, 1.0)},
        ValueError,
        "Invalid beta parameter at index 1: 1.0",
    ),
    # optim_error_inputs_func_sgd
    "momentum should be between 0 and 1": (
        torch.optim.SGD,
        None,
        {"lr": 1e-2, "momentum": -0.5},
        ValueError,
        "Invalid momentum value: -0.5",
    ),
    # the messages torch's optimizers give for the other settings they share with these
    "negative lr": (torch.optim.AdamW, None, {"lr": -0.1}, ValueError, "Invalid learning rate: -0.1"),
    "negative eps": (torch.optim.AdamW, None, {"lr": 1e-2, "eps": -1e-8}, ValueError, "Invalid epsilon value: -1e-08"),
}

#: torch's keyword -> this optimizer's (torch's SGD and Muon ``momentum`` is the EMA ``beta``).
OUR_NAMES = {"momentum": "beta"}
#: Inputs whose torch keyword names another setting here (AdamW's eps is ``adam_eps``).
OUR_KWARGS = {"negative eps": [{"eps": -1e-8}, {"adam_eps": -1e-8}]}

# The flags of torch's error inputs these optimizers do not take (the tensor-lr-with-foreach,
# fused and differentiable inputs): refused as unknown keywords, by name.
TORCH_ONLY_FLAGS = {
    "lr as Tensor with foreach": {"lr": torch.tensor(0.001), "foreach": True},
    "betas as Tensors with foreach": {"lr": 1e-2, "betas": (torch.tensor(0.9), torch.tensor(0.99)), "foreach": True},
    "fused and foreach": {"foreach": True, "fused": True},
    "fused and differentiable": {"fused": True, "differentiable": True},
}


def _ours(case):
    _, _, kwargs, _, _ = TORCH_ERROR_INPUTS[case]
    return OUR_KWARGS.get(case, [{OUR_NAMES.get(k, k): v for k, v in kwargs.items()}])


@pytest.mark.parametrize("case", [c for c, v in TORCH_ERROR_INPUTS.items() if v[0] is not None])
def test_the_copied_inputs_raise_so_in_torch(case):
    optim, params, kwargs, error, pattern = TORCH_ERROR_INPUTS[case]
    with pytest.raises(error, match=pattern):
        optim(None if params is None else params(), **kwargs)


@pytest.mark.parametrize("case", list(TORCH_ERROR_INPUTS))
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_torchs_error_inputs_raise_what_torch_raises(cls, case):
    _, params, _, error, pattern = TORCH_ERROR_INPUTS[case]
    for kwargs in _ours(case):
        with pytest.raises(error, match=pattern):
            cls(None if params is None else params(), **kwargs)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_hyperparameters_are_checked_before_params_are_read(cls):
    """Whatever ``params`` is (None, a tensor, a set: each refused as torch refuses it),
    an invalid hyperparameter is what is reported, as torch reports it."""
    for params in (None, _p(3, 3), {_p(3, 3)}, [], object()):
        with pytest.raises(ValueError, match=r"^Tensor lr must be 1-element"):
            cls(params, lr=torch.tensor([1.0, 2.0]))
        with pytest.raises(ValueError, match=r"^Invalid learning rate: -1 \(field 'lr': must be >= 0"):
            cls(params, lr=-1)
        with pytest.raises(ValueError, match=r"^Invalid momentum value: 1.0 \(field 'beta'"):
            cls(params, beta=1.0)
    if cls is EquivariantOptimizer:
        with pytest.raises(ValueError, match=r"^Invalid rule: 'lion' \(field 'rule': unknown rule 'lion'"):
            cls(None, rule="lion")
    # valid hyperparameters: params=None then fails where torch's optimizers fail
    with pytest.raises(TypeError):
        cls(None)
    with pytest.raises(TypeError):
        torch.optim.AdamW(None)


@pytest.mark.parametrize("case", list(TORCH_ONLY_FLAGS))
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_torchs_kernel_flags_are_refused_by_name(cls, case):
    kwargs = TORCH_ONLY_FLAGS[case]
    flag = next(k for k in ("foreach", "fused") if k in kwargs)
    with pytest.raises(TypeError, match=flag):
        cls([_p(3, 3)], **kwargs)


def test_muons_error_inputs_where_equiopt_differs():
    """optim_error_inputs_func_muon: equiopt's Muon steps stacks of matrices (a 3-D
    parameter with layout ``"experts:row"``) where torch's refuses anything but 2-D; an unknown
    shape factor (torch's ``adjust_lr_fn``, here ``lr_scale``) and a complex parameter are
    refused at construction."""
    Muon([_p(2, 3, 4)], layout="experts:row")
    with pytest.raises(ValueError, match="unknown lr_scale 'arbitrary'"):
        Muon([_p(2, 3)], lr_scale="arbitrary")
    with pytest.raises(RuntimeError, match="does not support complex parameters"):
        Muon([torch.nn.Parameter(torch.rand(2, 3, dtype=torch.complex64))])


# ------------------------------------------------------------------ names
RULES = ["spectral", "row", "hybrid", "normuon", "adamw"]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))


def _groups(model, rule, named):
    items = list(model.named_parameters())
    pick = (lambda ps: ps) if named else (lambda ps: [p for _, p in ps])
    mats = [(n, p) for n, p in items if p.ndim == 2]
    vecs = [(n, p) for n, p in items if p.ndim == 1]
    return [{"params": pick(mats), "rule": rule}, {"params": pick(vecs), "rule": "adamw"}]


def _steps(model, opt, k=2):
    g = torch.Generator().manual_seed(3)
    for _ in range(k):
        opt.zero_grad()
        model(torch.randn(5, 6, generator=g)).square().mean().backward()
        opt.step()


def _without(sd, key):
    return [{k: v for k, v in g.items() if k != key} for g in sd["param_groups"]]


def _assert_same(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, st in a["state"].items():
        assert st.keys() == b["state"][i].keys()
        for key, value in st.items():
            assert torch.equal(value, b["state"][i][key]), (i, key)


@pytest.mark.parametrize("rule", RULES)
def test_state_dicts_of_equal_optimizers_differ_in_param_names_alone(rule):
    """Two equal optimizers, one built from ``named_parameters()``: their state dicts
    differ in torch's ``param_names`` and nowhere else, as torch's own optimizers'."""
    m1, m2 = _model(), _model()
    plain = EquivariantOptimizer(_groups(m1, rule, named=False), lr=0.01)
    named = EquivariantOptimizer(_groups(m2, rule, named=True), lr=0.01)
    _steps(m1, plain)
    _steps(m2, named)
    a, b = plain.state_dict(), named.state_dict()
    assert all("names" not in g and "param_names" not in g for g in a["param_groups"])
    assert [g["param_names"] for g in b["param_groups"]] == [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    assert _without(a, "param_names") == _without(b, "param_names")
    _assert_same({**a, "param_groups": []}, {**b, "param_groups": []})
    # torch's optimizers differ just so
    t1, t2 = torch.optim.AdamW(m1.parameters()), torch.optim.AdamW(m2.named_parameters())
    assert _without(t1.state_dict(), "param_names") == _without(t2.state_dict(), "param_names")
    # the names messages use are the live groups', not saved
    assert plain.param_groups[0]["names"] == ["param_groups[0].params[0]", "param_groups[0].params[1]"]
    assert named.param_groups[0]["names"] == named.param_groups[0]["param_names"] == ["0.weight", "1.weight"]


def test_names_given_in_a_group_are_param_names():
    """``names``, the earlier spelling, name the parameters as ``param_names`` do: the
    state dict is the one of an optimizer built from ``named_parameters()``."""
    m1, m2 = _model(), _model()
    groups = _groups(m1, "row", named=False)
    groups[0]["names"], groups[1]["names"] = ["0.weight", "1.weight"], ["0.bias", "1.bias"]
    given = EquivariantOptimizer(groups, lr=0.01)
    named = EquivariantOptimizer(_groups(m2, "row", named=True), lr=0.01)
    _steps(m1, given)
    _steps(m2, named)
    _assert_same(given.state_dict(), named.state_dict())
    with pytest.raises(ValueError, match="'names'.*'param_names'.*differ"):
        EquivariantOptimizer([{"params": [("a", _p(3, 3))], "names": ["b"]}])
    with pytest.raises(ValueError, match="'param_names' has 1 entries for 2 parameters"):
        EquivariantOptimizer([{"params": [_p(3, 3), _p(3, 3)], "param_names": ["a"]}])


def _old_form(sd, names):
    """``sd`` as an earlier version saved it: every group with ``names`` beside torch's
    optional ``param_names`` (the places when unnamed)."""
    old = copy.deepcopy(sd)
    for i, group in enumerate(old["param_groups"]):
        group["names"] = names[i] if names else [f"param_groups[{i}].params[{j}]" for j in range(len(group["params"]))]
    return old


@pytest.mark.parametrize("saved", ["unnamed", "names", "names and param_names"])
@pytest.mark.parametrize("into", ["unnamed", "named"])
def test_a_state_dict_of_the_old_form_with_names_loads(saved, into):
    model = _model()
    names = [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    source = EquivariantOptimizer(_groups(model, "hybrid", named=saved == "names and param_names"), lr=0.01)
    _steps(model, source)
    new = source.state_dict()
    old = _old_form(new, names if saved != "unnamed" else None)  # "names": a group named by names alone
    if saved == "names":  # what the same optimizer saves now
        for group, ns in zip(new["param_groups"], names):
            group["param_names"] = ns
    assert all("names" in g for g in old["param_groups"])
    twin_model = copy.deepcopy(model)
    twin = EquivariantOptimizer(_groups(twin_model, "hybrid", named=into == "named"), lr=0.5)
    twin.load_state_dict(old)
    reference = EquivariantOptimizer(_groups(copy.deepcopy(model), "hybrid", named=into == "named"), lr=0.5)
    reference.load_state_dict(new)
    _assert_same(twin.state_dict(), reference.state_dict())
    got = twin.state_dict()["param_groups"]
    assert all("names" not in g for g in got)
    if saved == "unnamed" and into == "unnamed":
        assert all("param_names" not in g for g in got)
        assert twin.param_groups[1]["names"] == ["param_groups[1].params[0]", "param_groups[1].params[1]"]
    else:  # the saved names (or this optimizer's, the same) are torch's param_names now
        assert [g["param_names"] for g in got] == names
        assert [g["names"] for g in twin.param_groups] == names
    _steps(model, source)
    _steps(twin_model, twin)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
