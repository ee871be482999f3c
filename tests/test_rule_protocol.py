"""A rule defined in this file alone (equiopt.optim.rules' protocol and one register call)
steps as its float64 formula on one process, on every path of the step (stacked buckets,
a layout of several work matrices, per parameter), appears in the settings table while
registered, and steps a ``fully_shard``-ed model on 2 gloo ranks as on one process (its
map on row shards, with the row sums completed across ranks)."""

import copy

import pytest
import torch
from sharded_steps import give_grads, global_grads, rel

from equiopt import maps
from equiopt.optim import EquivariantOptimizer, fields
from equiopt.optim.rules import MOMENTUM_FIELDS, Rule, register, registered, rule_named, unregister


class UnitRMS(Rule):
    """Each work matrix of the momentum scaled to RMS one: ``U = D / sqrt(mean(D^2) + eps)``
    (equivariant under ``O(m) x O(n)``); its sum of squares completes over row shards."""

    name = "unit_rms"
    doc = "each work matrix to RMS one"
    fields = MOMENTUM_FIELDS + ("eps",)
    defaults = {"nesterov": True}

    def reducible(self, key, rows, cols):
        return True

    def factored(self, key, eta, D, *, reducer, col_reducer, narrow, centred_input):
        sq = D.float().square().sum(dim=(-2, -1), keepdim=True)
        rows = D.shape[-2] if reducer is None else reducer.count
        if reducer is not None:
            sq = reducer.sum(sq)
        return maps.Factored(D * torch.rsqrt(sq / (rows * D.shape[-1]) + key.eps).to(D.dtype))


def _reference(weights, grads_per_step, lr, beta, eps, wd, blocks):
    """float64: EMA momentum, Nesterov's direction, each work matrix (``blocks``: how a
    weight splits into them) to RMS one."""
    W = [w.double().clone() for w in weights]
    M = [torch.zeros_like(w) for w in W]
    for grads in grads_per_step:
        for k, g in enumerate(grads):
            M[k] = beta * M[k] + (1 - beta) * g.double()
            D = beta * M[k] + (1 - beta) * g.double()
            U = torch.cat([b / torch.sqrt(b.square().mean() + eps) for b in blocks[k](D)], dim=-1)
            W[k] = W[k] * (1 - lr * wd) - lr * U.reshape(W[k].shape)
    return W


def test_a_rule_of_this_file_steps_as_its_float64_formula_and_shows_in_the_table():
    assert "unit_rms" not in fields.RULES
    torch.manual_seed(0)
    shapes = [(8, 6), (8, 6), (5, 7), (6, 8)]  # two stack into a bucket; the last splits into two heads
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float32)) for s in shapes]
    whole = lambda m: [m]
    heads = lambda m: list(m.split(4, dim=1))  # "heads_cols:4": two 6 x 4 work matrices side by side
    layouts = ["row", "row", "row", "heads_cols:4"]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    start = [p.detach().clone() for p in params]
    with registered(UnitRMS()):
        assert "unit_rms" in fields.RULES and "unit_rms" in fields.MATRIX_RULES
        assert fields.RULE_FIELDS["unit_rms"] == (
            "rule",
            "lr",
            "weight_decay",
            "beta",
            "nesterov",
            "eps",
            "nonfinite",
            "lazy",
        )
        assert fields.RULE_DEFAULTS["unit_rms"]["nesterov"] is True  # its own default, not the table's
        table = fields.fields_table()
        assert "unit_rms" in table.split("| `eps` |")[1].split("\n")[0]
        assert "unit_rms (each work matrix to RMS one)" in table.split("| `rule` |")[1].split("\n")[0]
        opt = EquivariantOptimizer(
            [{"params": params, "layouts": layouts}],
            rule="unit_rms",
            lr=0.05,
            beta=0.9,
            weight_decay=0.1,
            eps=1e-6,
        )
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        assert opt._buckets is not None and len(opt._buckets.covered) == 4, "the stacked path was not taken"
    assert "unit_rms" not in fields.RULES
    want = _reference(start, grads, 0.05, 0.9, 1e-6, 0.1, [whole, whole, whole, heads])
    for k, (p, w) in enumerate(zip(params, want)):
        assert rel(p.detach().double(), w) < 1e-6, (k, rel(p.detach().double(), w))


def test_register_refuses_what_the_step_could_not_run():
    class NoName(Rule):
        pass

    class Unknown(UnitRMS):
        name = "unknown_field"
        fields = ("beta", "bogus")

    class BadKind(UnitRMS):
        name = "bad_kind"
        kind = "tensorwise"

    with pytest.raises(ValueError, match="needs a non-empty name"):
        register(NoName())
    with pytest.raises(ValueError, match=r"reads unknown settings \['bogus'\]"):
        register(Unknown())
    with pytest.raises(ValueError, match="kind must be matrix, elementwise or peer"):
        register(BadKind())
    with pytest.raises(ValueError, match="a rule named 'spectral' is registered already"):
        register(type("Again", (UnitRMS,), {"name": "spectral"})())
    with pytest.raises(ValueError, match="unknown rule 'unit_rms'; valid: spectral"):
        rule_named("unit_rms")
    with pytest.raises(TypeError, match="expected an equiopt.optim.rules.Rule"):
        register(object())  # type: ignore[arg-type]
    with registered(UnitRMS()):
        with pytest.raises(ValueError, match="field 'eps': must be > 0"):
            EquivariantOptimizer([torch.nn.Parameter(torch.ones(3, 3))], rule="unit_rms", eps=-1.0)
    with pytest.raises(KeyError):
        unregister("unit_rms")


def _fsdp2_steps(rank, world):
    from torch.distributed.tensor import DTensor

    from equiopt.models import build
    from equiopt.train.parallel import apply_fsdp2

    with registered(UnitRMS()):
        ref = build("qwen3", "tiny", seed=0)
        sharded = apply_fsdp2(copy.deepcopy(ref), torch.device("cpu"), world)

        def groups(model):
            named = list(model.named_parameters())
            return [
                {"params": [p for _, p in named if p.ndim == 2], "rule": "unit_rms", "lr": 0.02},
                {"params": [p for _, p in named if p.ndim != 2], "rule": "adamw", "lr": 1e-3},
            ]

        opt_ref, opt = EquivariantOptimizer(groups(ref)), EquivariantOptimizer(groups(sharded))
        for step in range(2):
            give_grads(global_grads(ref, step, seed=1000), ref, sharded)
            opt_ref.step()
            opt.step()
        want, start = dict(ref.named_parameters()), dict(build("qwen3", "tiny", seed=0).named_parameters())
        worst = 0.0
        for name, p in sharded.named_parameters():
            assert isinstance(p, DTensor), name
            worst = max(worst, rel(p.full_tensor(), want[name].detach()))
            assert rel(want[name].detach(), start[name].detach()) > 0, f"{name} did not move"
        first = opt.param_groups[0]
        plans = {opt.plan_of(first, first["layouts"][j], opt._sharding(p)).how for j, p in enumerate(first["params"])}
    return worst, sorted(plans)


@pytest.mark.slow
def test_a_rule_of_this_file_steps_fsdp2_shards_as_one_process(gloo):
    results = gloo(_fsdp2_steps, 2)
    for worst, plans in results:
        assert worst <= 1e-5, worst
        assert "reduce" in plans, plans  # the map ran on row shards, its sums completed across ranks
