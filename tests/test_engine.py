"""The step as an accelerator and a compiler see it: no host reads, a compilable step,
skips decided with tensors."""

import pytest
import torch

import equiopt as eo
from equiopt.optim import EquivariantOptimizer

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")

FAMILY_OF = {"qwen3": "qwen3", "gemma3": "gemma3", "olmoe": "olmoe", "gpt_oss": "gpt_oss"}


def _family(recipe: str) -> str:
    parts = recipe.split(":")
    return parts[1] if parts[0] == "paper" else "qwen3"


@pytest.fixture(scope="module")
def models():
    return {f: eo.models.build(f, "tiny", seed=0) for f in FAMILY_OF}


def _backward(model, seed=0):
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()


class ReadCounter:
    def __init__(self, monkeypatch):
        self.calls = []
        for name in READS:
            real = getattr(torch.Tensor, name)

            def spy(t, *a, _real=real, _name=name, **k):
                self.calls.append(_name)
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, spy)


@pytest.mark.parametrize("recipe", eo.recipes.list_recipes())
def test_no_host_reads_in_the_step(recipe, models, monkeypatch):
    model = models[_family(recipe)]
    opt, sched = eo.build_optimizer(model, recipe, total_steps=10)
    _backward(model)
    next(iter(model.parameters())).grad[0, 0] = float("nan")  # the skip path too
    counter = ReadCounter(monkeypatch)
    for _ in range(2):
        opt.step()
    assert counter.calls == [], f"{recipe}: host reads {counter.calls}"
    float(torch.ones(()))
    assert counter.calls == ["__float__"]  # the spies see reads
    monkeypatch.undo()
    assert opt.nonfinite_steps == 2


RULES = [
    {"rule": "spectral", "layout": "heads:4"},
    {"rule": "right", "center": True},
    {"rule": "left", "center": True, "alpha": 1.0},
    {"rule": "row"},
    {"rule": "row", "center": True},
    {"rule": "hybrid", "order": "row_then_right", "center": True},
    {"rule": "hybrid", "order": "left_then_row", "center": True},
    {"rule": "sgd"},
    {"rule": "adamw", "weight_decay": 0.1},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("settings", RULES, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_skip_leaves_weights_and_state_untouched_and_others_move(settings, dtype):
    g = torch.Generator().manual_seed(0)
    bad, good = (torch.nn.Parameter((0.02 * torch.randn(16, 8, generator=g)).to(dtype)) for _ in range(2))
    opt = EquivariantOptimizer([{"params": [bad, good], "names": ["bad", "good"], **settings}], lr=0.1, weight_decay=0.01)
    for step in range(3):
        for p in (bad, good):
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        if step == 2:
            bad.grad[3, 1] = float("inf") if dtype == torch.float32 else float("nan")
            before = bad.detach().clone(), {k: v.clone() for k, v in opt.state[bad].items()}
            good_before = good.detach().clone()
        opt.step()
    assert torch.equal(bad.detach(), before[0])
    for key, value in before[1].items():
        if key != "nonfinite":
            assert torch.equal(opt.state[bad][key], value), key
    assert not torch.equal(good.detach(), good_before)
    assert opt.nonfinite_steps == 1 and opt.last_nonfinite == ["bad"]
    assert opt.state[bad]["nonfinite"].item() == 1 and opt.state[good]["nonfinite"].item() == 0


def test_counters_survive_torch_distributed_checkpoint_state_dicts(models):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = models["olmoe"]
    opt, _ = eo.build_optimizer(model, "paper:olmoe:ii")
    _backward(model)
    model.lm_head.weight.grad[0, 0] = float("nan")
    opt.step()
    sd = get_optimizer_state_dict(model, opt)
    assert set(sd) == {"state", "param_groups"}
    fresh, _ = eo.build_optimizer(model, "paper:olmoe:ii")
    set_optimizer_state_dict(model, fresh, sd)
    assert fresh.nonfinite_steps == opt.nonfinite_steps == 1
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert torch.equal(fresh.state[p][key], value), key
