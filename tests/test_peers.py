"""torch's own optimizers as rules (peer arms): bitwise torch, state and resumption, clear refusals."""

import copy
import sys

import pytest
import torch

from equiopt import build_optimizer, models
from equiopt.linalg import bfloat16_products
from equiopt.optim import EquivariantOptimizer
from equiopt.recipes import get_recipe

needs_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _run(opt, params, steps, lrs=None, start=0):
    for k in range(start, start + steps):
        for p, g in zip(params, _grads(params, k)):
            p.grad = g
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[k]
        opt.step()


def test_torch_adamw_rule_is_torchs_adamw_bit_for_bit_with_a_schedule_and_resume():
    shapes = [(12, 8), (8,), (3, 4, 5)]
    ours, ref = _params(shapes), _params(shapes)
    lrs = [1e-2 * (0.8**k) for k in range(6)]
    opt = EquivariantOptimizer(
        [
            {
                "params": ours,
                "rule": "torch_adamw",
                "lr": lrs[0],
                "betas": (0.9, 0.99),
                "adam_eps": 1e-7,
                "weight_decay": 0.1,
            }
        ]
    )
    torch_opt = torch.optim.AdamW(ref, lr=lrs[0], betas=(0.9, 0.99), eps=1e-7, weight_decay=0.1, foreach=True)
    _run(opt, ours, 3, lrs)
    _run(torch_opt, ref, 3, lrs)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    # resume from a state dict into a fresh optimizer over copies of the weights
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt2 = EquivariantOptimizer([{"params": resumed, "rule": "torch_adamw", "lr": 1.0}])
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.param_groups[0]["betas"] == (0.9, 0.99)
    _run(opt2, resumed, 3, lrs, start=3)
    _run(torch_opt, ref, 3, lrs, start=3)
    assert all(torch.equal(a, b) for a, b in zip(resumed, ref))
    assert set(opt2.state[resumed[0]]) >= {"step", "exp_avg", "exp_avg_sq"}


@needs_muon
@pytest.mark.parametrize("lr_scale, torch_fn", [("spectral", "original"), ("match_adamw", "match_rms_adamw")])
def test_torch_muon_rule_is_torchs_muon_bit_for_bit(lr_scale, torch_fn):
    shapes = [(16, 8), (8, 24)]
    ours, ref = _params(shapes), _params(shapes)
    opt = EquivariantOptimizer(
        [
            {
                "params": ours,
                "rule": "torch_muon",
                "lr": 0.02,
                "beta": 0.9,
                "steps": 4,
                "weight_decay": 0.01,
                "lr_scale": lr_scale,
            }
        ]
    )
    torch_opt = torch.optim.Muon(
        ref, lr=0.02, momentum=0.9, nesterov=True, ns_steps=4, weight_decay=0.01, adjust_lr_fn=torch_fn
    )
    _run(opt, ours, 4)
    with bfloat16_products(torch.device("cpu")):  # torch's products as the rule runs them on this CPU
        _run(torch_opt, ref, 4)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert torch.equal(opt.state[ours[0]]["momentum_buffer"], torch_opt.state[ref[0]]["momentum_buffer"])


@needs_muon
def test_torch_muon_rule_multiplies_as_the_cpu_does(monkeypatch):
    """With bfloat16 hardware the rule is torch.optim.Muon as torch runs it, bit for bit; without
    it, its products are float32 products rounded to bfloat16, within bfloat16's rounding noise
    of torch's own kernels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ProductDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.seen.add(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    polar_module = sys.modules["equiopt.linalg.polar"]
    shapes = [(48, 24), (24, 64)]
    for native in (True, False):
        monkeypatch.setattr(polar_module, "CPU_BFLOAT16", native)
        ours, ref, start = _params(shapes), _params(shapes), _params(shapes)
        group = {"params": ours, "rule": "torch_muon", "lr": 0.02, "beta": 0.95, "steps": 5, "weight_decay": 0.1}
        with ProductDtypes() as products:  # what reaches torch's kernels
            _run(EquivariantOptimizer([group]), ours, 4)
        assert products.seen == {torch.bfloat16 if native else torch.float32}
        # torch's own kernels
        _run(torch.optim.Muon(ref, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.1), ref, 4)
        for a, b, w0 in zip(ours, ref, start):
            if native:
                assert torch.equal(a, b)
            else:
                assert (a - b).norm() < 1e-2 * (b - w0).norm()


@needs_muon
def test_peer_rules_refuse_what_torch_cannot_step_by_name():
    with pytest.raises(ValueError, match="parameter 'experts' has shape \\(2, 3, 4\\): rule 'torch_muon'"):
        EquivariantOptimizer([{"params": _params([(2, 3, 4)]), "rule": "torch_muon", "names": ["experts"]}])
    with pytest.raises(ValueError, match="field 'lr_scale': unknown lr_scale 'none' for rule 'torch_muon'"):
        EquivariantOptimizer([{"params": _params([(4, 4)]), "rule": "torch_muon", "lr_scale": "none"}])
    with pytest.raises(ValueError, match="field 'nonfinite'"):
        get_recipe("peer:adamw").with_overrides({"vector": {"nonfinite": "raise"}})


@needs_muon
def test_peer_muon_recipe_steps_a_model_like_torch_and_mixes_with_own_rules():
    model = models.build("qwen3", "tiny", seed=0)
    twin = copy.deepcopy(model)
    opt, sched = build_optimizer(model, "peer:muon", total_steps=10)
    assert {g["rule"] for g in opt.param_groups} == {"torch_muon", "torch_adamw"}
    # the same partition by hand, with torch's classes
    hidden = {id(p) for g in opt.param_groups if g["rule"] == "torch_muon" for p in g["params"]}
    named = dict(twin.named_parameters())
    own = dict(model.named_parameters())
    twin_hidden = [named[n] for n, p in own.items() if id(p) in hidden]
    muon_group = next(g for g in opt.param_groups if g["rule"] == "torch_muon")
    torch_muon = torch.optim.Muon(twin_hidden, lr=muon_group["lr"], momentum=0.95, nesterov=True, weight_decay=0.0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for m in (model, twin):
        m(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with bfloat16_products(torch.device("cpu")):
        torch_muon.step()
    for n, p in own.items():
        if id(p) in hidden:
            assert torch.equal(p, named[n]), n
    sched.step()


@needs_muon
def test_peer_muon_refuses_stacked_experts_naming_them():
    model = models.build("olmoe", "tiny", seed=0)
    with pytest.raises(ValueError, match="rule 'torch_muon' \\(torch.optim.Muon\\) steps 2-D matrices only"):
        build_optimizer(model, "peer:muon")


def test_zero_gradient_step_at_lr_zero_changes_nothing_for_peer_rules():
    params = _params([(6, 4), (4,)])
    before = [p.detach().clone() for p in params]
    rules = [("torch_adamw", params)]
    if hasattr(torch.optim, "Muon"):
        rules.append(("torch_muon", params[:1]))
    for rule, ps in rules:
        opt = EquivariantOptimizer([{"params": ps, "rule": rule, "lr": 0.0}])
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt.step()
        assert all(torch.equal(p, b) for p, b in zip(ps, before))
        assert all(torch.isfinite(t).all() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
