"""The step as an accelerator and a compiler see it: no host reads, a compilable step,
skips decided with tensors."""

import pytest
import torch
from _launch import background

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


# peer:* recipes run torch's own optimizers, whose foreach AdamW reads its CPU step counters
@pytest.mark.parametrize("recipe", [r for r in eo.recipes.list_recipes() if not r.startswith("peer:")])
def test_no_host_reads_in_the_step(recipe, models, monkeypatch):
    model = models[_family(recipe)]
    opt, sched = eo.build_optimizer(model, recipe, total_steps=10)
    _backward(model)
    first = next(iter(model.parameters()))
    counter = ReadCounter(monkeypatch)
    for _ in range(2):
        first.grad[0, 0] = float("nan")  # the skip path too (a skip zeroes that gradient)
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
    opt = EquivariantOptimizer(
        [{"params": [bad, good], "names": ["bad", "good"], **settings}], lr=0.1, weight_decay=0.01
    )
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
    assert not bad.grad[3, 1].isfinite()  # the step never writes the caller's gradient


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


SPECS = [
    ({"rule": "spectral", "layout": "heads:4", "polar_dtype": torch.float32}, (16, 12)),
    ({"rule": "right", "center": True}, (24, 8)),
    ({"rule": "left", "center": True, "alpha": 1.0}, (4, 16)),
    ({"rule": "row"}, (24, 8)),
    ({"rule": "row", "center": True}, (24, 8)),
    ({"rule": "hybrid", "order": "row_then_right", "layout": "experts:gate_up"}, (2, 12, 8)),
    ({"rule": "sgd"}, (6, 4)),
    ({"rule": "adamw", "weight_decay": 0.1}, (8,)),
    ({"rule": "hybrid", "scale": "rms", "lazy": True}, (48, 6)),  # gets embedding-like sparse gradients
]


def _build(copies, **options):
    g = torch.Generator().manual_seed(0)
    groups = [
        {"params": [torch.nn.Parameter(0.02 * torch.randn(*shape, generator=g)) for _ in range(copies)], **settings}
        for settings, shape in SPECS
    ]
    opt = EquivariantOptimizer(groups, lr=0.01, weight_decay=0.01, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return [p for gr in groups for p in gr["params"]], opt, sched


def _train(params, opt, sched, step, steps=4):
    g = torch.Generator().manual_seed(1)
    for k in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
            if p.shape == (48, 6):
                p.grad[torch.rand(48, generator=g) < 0.5] = 0
        if k == 2:
            params[0].grad[0, 0] = float("nan")
        step()
        sched.step()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("copies", [1, 3])
def test_user_compiled_step_traces_a_bounded_number_of_graphs(copies):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    params, opt, sched = _build(copies)
    _train(params, opt, sched, torch.compile(opt.step, backend=counter))
    ref, ref_opt, ref_sched = _build(copies)
    _train(ref, ref_opt, ref_sched, ref_opt.step)
    # one graph before the state exists and one after, whatever the parameter count and
    # however the schedule moves the learning rates
    assert counter.frame_count == 2
    for a, b in zip(params, ref):
        assert _rel(a, b) <= 1e-5
    assert opt.nonfinite_steps == ref_opt.nonfinite_steps == 1


@pytest.mark.slow
def test_engine_compile_option_equals_eager():
    params, opt, sched = _build(2, compile="aot_eager")
    _train(params, opt, sched, opt.step)
    ref, ref_opt, ref_sched = _build(2, compile=False)
    _train(ref, ref_opt, ref_sched, ref_opt.step)
    assert opt._compiled_step is not None
    for a, b in zip(params, ref):
        assert _rel(a, b) <= 1e-5
    assert [s["nonfinite"].item() for s in opt.state.values()] == [
        s["nonfinite"].item() for s in ref_opt.state.values()
    ]


INDUCTOR_SCRIPT = """
import torch
import test_engine as t
params, opt, sched = t._build(1)
t._train(params, opt, sched, torch.compile(opt.step))
ref, ref_opt, ref_sched = t._build(1)
t._train(ref, ref_opt, ref_sched, ref_opt.step)
worst = max(t._rel(a, b) for a, b in zip(params, ref))
print("worst", worst)
assert worst <= 1e-5, worst
"""


def _cold_inductor():
    """The check of the test below in a subprocess of its own, on an empty Inductor cache."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    cache = tempfile.mkdtemp(prefix="inductor-cold-")
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=cache,
        TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", INDUCTOR_SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.cache = cache  # type: ignore[attr-defined]  # (removed by the test)
    return proc


@pytest.mark.slow
@background(_cold_inductor)
def test_inductor_compiled_step_from_a_cold_cache_equals_eager(started):
    """``torch.compile(optimizer.step)`` with Inductor on a CPU, nothing cached (its
    subprocess starts with the session, beside the other tests: conftest's ``background``)."""
    import shutil

    out, err = started.communicate(timeout=900)
    shutil.rmtree(started.cache, ignore_errors=True)
    assert started.returncode == 0, err[-3000:]
    assert "worst" in out


@pytest.mark.parametrize(
    "error",
    [
        torch._dynamo.exc.Unsupported("no backend here"),
        # what Dynamo's own assertions raise (torch 2.11 on an attribute set inside the graph)
        AssertionError("Attempted setattr on a user-defined object"),
    ],
)
def test_automatic_compile_warns_and_steps_eagerly_when_compiling_fails(monkeypatch, error):
    """Under the automatic setting a failed compile costs a warning, not the run; an
    explicit ``compile=`` raises."""
    monkeypatch.setattr(EquivariantOptimizer, "_on_cuda", lambda self: True)
    (p,), opt, _ = _one(compile=None)

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    before = p.detach().clone()
    with pytest.warns(UserWarning, match="stepping eagerly"):
        opt.step()
    assert not torch.equal(p.detach(), before) and opt._compile_failed
    (q,), strict, _ = _one(compile="inductor")
    with pytest.raises(type(error)):
        strict.step()


def test_compiled_step_sets_no_attribute_of_the_optimizer(monkeypatch):
    """Dynamo (torch 2.11) refuses an attribute set on the optimizer inside the graph: the
    step returns its flags and finds its skip counter made, and sets nothing itself."""
    (p,), opt, _ = _one(compile=False)
    opt._skip_counter()
    original = type(opt).__setattr__
    sets: list[str] = []

    def record(self, name, value):
        sets.append(name)
        original(self, name, value)

    monkeypatch.setattr(type(opt), "__setattr__", record)
    flags = opt._step_impl(opt._lr_tensors())
    assert sets == []
    assert len(flags) == 1 and flags[0][1].dtype == torch.bool and flags[0][1].shape == (1,)
    assert opt.nonfinite_updates == 0


def _one(**options):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 4, generator=g))
    p.grad = torch.randn(8, 4, generator=g)
    opt = EquivariantOptimizer([p], rule="row", lr=0.1, **options)
    return (p,), opt, None


def _largest_allocation(fn) -> int:
    """Bytes of the largest single CPU allocation made while ``fn`` runs."""
    from torch.profiler import profile

    with profile(profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


@pytest.mark.parametrize(
    "settings",
    [
        {"rule": "row", "center": True},
        {"rule": "right", "center": True, "alpha": 1.0},
        {"rule": "row", "center": True, "layout": "col"},
    ],
    ids=["row", "right", "row-col-layout"],
)
def test_centred_maps_keep_the_momentum_in_the_quotient_and_copy_nothing_full_size(settings):
    """A centred map sees only Pi M, so the step stores Pi M (exact: Pi is linear) and
    maps it without forming a centred copy of the matrix."""
    m, n = (512, 32) if settings.get("layout") != "col" else (32, 512)
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(0.02 * torch.randn(m, n, generator=g))
    opt = EquivariantOptimizer([{"params": [p], **settings}], lr=0.01, beta=0.9)
    M = torch.zeros(m, n, dtype=torch.float64)
    for _ in range(3):
        G = torch.randn(m, n, generator=g) + 0.5  # a shared-row component for the centring to remove
        p.grad = G.clone()
        M = 0.9 * M + 0.1 * G.double()
        opt.step()
    work = (lambda t: t.mT) if settings.get("layout") == "col" else (lambda t: t)
    stored = work(opt.state[p]["momentum_buffer"]).double()
    expected = work(M) - work(M).mean(dim=-2, keepdim=True)
    torch.testing.assert_close(stored, expected, rtol=1e-5, atol=1e-6)
    assert stored.mean(dim=-2).abs().max() < 1e-6
    full = m * n * 4
    assert _largest_allocation(opt.step) < full // 4


def test_fullgraph_compile_of_the_step_says_what_to_use_instead():
    p = torch.nn.Parameter(torch.randn(16, 8))
    opt = EquivariantOptimizer([p], lr=0.01)
    p.grad = torch.randn(16, 8)
    with pytest.raises(Exception, match=r"compile=True\), capture it with equiopt.optim.GraphedStep"):
        torch.compile(opt.step, fullgraph=True, backend="eager")()
