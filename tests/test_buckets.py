"""Buckets (equiopt.optim.buckets): stacked state, a step in a bounded number of operators,
the same updates as the per-parameter path, buffers made once."""

import copy

import pytest
import torch

from equiopt.optim import EquivariantOptimizer, GraphedStep

# rules and layouts whose parameters are stacked; each case: group settings, parameter shapes
CASES = [
    ({"rule": "spectral", "layout": "heads:4"}, [(16, 8), (16, 8), (16, 8)]),
    ({"rule": "spectral", "layout": "heads_cols:4", "weight_decay": 0.1}, [(8, 16), (8, 16)]),
    ({"rule": "spectral", "layout": "col", "nesterov": False}, [(8, 24), (8, 24)]),
    ({"rule": "row", "center": True}, [(40, 8), (40, 8), (40, 8)]),
    ({"rule": "right", "center": True, "alpha": 0.5}, [(40, 8), (40, 8)]),
    ({"rule": "left", "center": True}, [(6, 32), (6, 32)]),
    ({"rule": "hybrid", "order": "row_then_right", "weight_decay": 0.05}, [(48, 8), (48, 8)]),
    ({"rule": "hybrid", "order": "right_then_row"}, [(48, 8)]),
    ({"rule": "hybrid", "order": "left_then_row", "center": True}, [(6, 32), (6, 32)]),
    ({"rule": "hybrid", "gram_dtype": "bfloat16"}, [(48, 8), (48, 8)]),
    ({"rule": "right", "center": True, "gram_dtype": "bfloat16x6"}, [(48, 8), (48, 8)]),
    ({"rule": "spectral_row", "layout": "heads:4"}, [(16, 8), (16, 8)]),
    ({"rule": "normuon", "layout": "heads:4", "weight_decay": 0.1}, [(16, 8), (16, 8), (16, 8)]),
    ({"rule": "normuon", "layout": "experts:col", "beta2": 0.9}, [(2, 6, 12), (2, 6, 12)]),
    ({"rule": "adamw", "weight_decay": 0.1}, [(8,), (3, 5), (8,), (2,)]),
    ({"rule": "adamw"}, [(300, 260), (300, 260)]),  # large: stacked by shape
]


def _params(shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _run(settings, shapes, nonfinite, steps=4, dtype=torch.float32, drop=None):
    """Weights and state after ``steps`` steps; ``nonfinite="raise"`` takes the per-parameter path."""
    params = _params(shapes, dtype)
    opt = EquivariantOptimizer(
        [{"params": params, **settings, "nonfinite": nonfinite}], lr=0.02, beta=0.9, method="exact"
    )
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for k, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g).to(dtype)
            p.grad = None if (drop is not None and step == steps - 1 and k == drop) else grad
        opt.step()
    return params, opt


@pytest.mark.parametrize("settings,shapes", CASES, ids=[str(c[0]) for c in CASES])
def test_buckets_step_as_the_per_parameter_path(settings, shapes):
    bucketed, opt = _run(settings, shapes, "skip")
    assert opt._buckets is not None and opt._buckets.covered == {id(p) for p in bucketed}
    single, ref = _run(settings, shapes, "raise")
    assert ref._buckets is None or not ref._buckets.covered
    for a, b in zip(bucketed, single):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
    for a, b in zip(bucketed, single):
        for key, value in ref.state[b].items():
            torch.testing.assert_close(opt.state[a][key], value, rtol=2e-5, atol=1e-6, msg=key)


# one bucket of several parts: stored as is, transposed (col) and split in heads, all with
# work matrices of 24 x 8, in three groups of equal map settings; and a fourth whose stored
# layout is no view of its work (interleaved gate and up columns)
PARTS = [("row", [(24, 8), (24, 8)]), ("col", [(8, 24)] * 3), ("heads:24", [(48, 8)])]
INTERLEAVED = ("gate_up:interleave:cols", [(8, 48), (8, 48)])
PART_RULES = [
    {"rule": "spectral"},
    {"rule": "spectral", "nesterov": False, "weight_decay": 0.1},
    {"rule": "row", "center": True},
    {"rule": "hybrid", "order": "row_then_right"},
    {"rule": "normuon"},
]


def _run_parts(settings, nonfinite, steps=3, copies=1, parts=PARTS):
    groups = [
        {"params": _params(shapes * copies, seed=k), "layout": layout, **settings, "nonfinite": nonfinite}
        for k, (layout, shapes) in enumerate(parts)
    ]
    opt = EquivariantOptimizer(groups, lr=0.02, beta=0.9, method="exact")
    params = [p for g in groups for p in g["params"]]
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


@pytest.mark.parametrize("settings", PART_RULES, ids=[str(s) for s in PART_RULES])
def test_a_bucket_of_several_parts_steps_as_the_per_parameter_path(settings):
    parts = [*PARTS, INTERLEAVED]
    bucketed, opt = _run_parts(settings, "skip", parts=parts)
    assert [len(b.parts) for b in opt._buckets.matrix] == [4]
    single, _ = _run_parts(settings, "raise", parts=parts)
    for a, b in zip(bucketed, single):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("settings", PART_RULES[:2], ids=["nesterov", "ema"])
def test_every_part_takes_its_gradients_in_through_the_fused_operators(settings):
    """Parts stored as their work matrices, transposed (``col``) or split in heads: each
    part's flags are one ``equiopt::grad_flags`` and its sanitising, momentum and direction
    one ``equiopt::momentum_stage``; no part reduces, sanitises or interpolates its gradients
    with operators of its own."""
    from equiopt.roofline import count_step

    params, opt = _run_parts(settings, "skip", steps=1)
    (bucket,) = opt._buckets.matrix
    for p in params:
        p.grad = torch.randn(p.shape)
    counter = count_step(opt.step, warmup=0)
    prologue = ("optim.stages.bucket_core", "optim.stages._gradients")  # (the guard sanitises updates)
    names = [o.name for o in counter.ops if o.stage in prologue]
    assert names.count("grad_flags") == names.count("momentum_stage") == len(bucket.parts) == 3, names
    for unfused in ("amin", "amax", "nan_to_num", "nan_to_num_", "lerp", "lerp_"):
        assert unfused not in names, (unfused, names)
    # the gradients are read where they are, not stacked first, and read once by each operator;
    # the transposed part's direction is written straight into its place (no copy after)
    assert not [o.name for o in counter.ops if o.stage == "optim.stages._side_by_side"]
    assert not [o for o in counter.ops if o.name == "clone" and o.read > 64]  # (the scales' are a few bytes)
    taken = [o.name for o in counter.ops if o.stage == "optim.buckets.take"]
    assert not {"stack", "_foreach_copy_", "copy_"} & set(taken), taken
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    flags = [o for o in counter.ops if o.name == "grad_flags"]
    counters = sum(opt.state[p]["nonfinite"].numel() * opt.state[p]["nonfinite"].element_size() for p in params)
    assert sum(o.read for o in flags) == grads + counters
    bucketed, _ = _run_parts(settings, "skip", steps=3)
    single, _ = _run_parts(settings, "raise", steps=3)
    for a, b in zip(bucketed, single):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def _counted_then_alike(run):
    """The operators of one eager step after ``run("skip", 1)``; and, checked here, three
    bucketed steps (``"skip"``) equal to three per-parameter ones (``"raise"``)."""
    from equiopt.roofline import count_step

    params, opt = run("skip", 1)
    for p in params:
        p.grad = torch.randn(p.shape)
    counter = count_step(opt.step, warmup=0)
    bucketed, _ = run("skip", 3)
    single, _ = run("raise", 3)
    for a, b in zip(bucketed, single):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
    return counter


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "ema"])
@pytest.mark.parametrize("rule", ["row", "hybrid"])
def test_a_row_norm_part_reads_its_rows_norms_off_the_momentum_stage(nesterov, rule):
    """RowNormM, and the hybrid's row stage, on matrices stored as their work matrices: the
    momentum stage sums the squares of the direction's rows as it writes them
    (``equiopt::momentum_stage`` given ``sums``), so the map reads the direction no more
    for its norms; the step equals the per-parameter path's."""

    def run(nonfinite: str, steps: int):
        g = torch.Generator().manual_seed(12)
        params = [torch.nn.Parameter(torch.randn(40, 16, generator=g)) for _ in range(3)]
        group = {"params": params, "rule": rule, "nesterov": nesterov, "nonfinite": nonfinite}
        other = {"params": [torch.nn.Parameter(torch.randn(40, 16))], "rule": rule}
        opt = EquivariantOptimizer([group, other], lr=0.01, weight_decay=0.1)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.param_groups[1]["params"][0].grad = torch.randn(40, 16, generator=g)
            opt.step()
        return params, opt

    counter = _counted_then_alike(run)
    stages = [o for o in counter.ops if o.name == "momentum_stage"]
    assert len(stages) == 2  # one a part, each writing its rows' sums (4 bytes a row) beside the momentum
    assert sorted(o.written % (4 * 40 * 16) for o in stages) == [4 * 40, 4 * 40 * 3]
    directions = [o for o in counter.ops if o.stage.startswith("maps.row")]
    assert not [o for o in directions if o.read >= 40 * 16 * 4], [(o.name, o.read) for o in directions]


def test_a_strided_gradient_is_stacked_and_steps_as_a_contiguous_one():
    """A part's gradients are read where they are only when each is contiguous: a member's
    strided gradient (of the same values) is stacked first, and the step is the same."""
    found = []
    for strided in (False, True):
        g = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(24, 16, generator=g)) for _ in range(3)]
        opt = EquivariantOptimizer(params, lr=0.02, method="exact", weight_decay=0.1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if strided:
                params[1].grad = params[1].grad.t().contiguous().t()
                assert not params[1].grad.is_contiguous()
            opt.step()
        found.append([p.detach().clone() for p in params])
    for a, b in zip(*found):
        assert torch.equal(a, b)


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "ema"])
def test_a_part_centred_in_place_takes_the_fused_operators_eagerly(nesterov):
    """A centred row-norm head (its momentum centred in place) takes its flags, sanitising
    and momentum through the fused operators in an eager step (under compile it keeps the
    unfused ones, see docs/step.md), and steps as the per-parameter path does."""

    def run(nonfinite: str, steps: int):
        g = torch.Generator().manual_seed(11)
        params = [torch.nn.Parameter(torch.randn(40, 16, generator=g)) for _ in range(3)]
        group = {"params": params, "rule": "row", "center": True, "nesterov": nesterov, "nonfinite": nonfinite}
        opt = EquivariantOptimizer([group], lr=0.01, weight_decay=0.1)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) + 1.0
            opt.step()
        return params, opt

    counter = _counted_then_alike(run)
    names = [o.name for o in counter.ops if o.stage in ("optim.stages.bucket_core", "optim.stages._gradients")]
    assert names.count("grad_flags") == names.count("momentum_stage") == 1, names
    for unfused in ("amin", "amax", "nan_to_num", "nan_to_num_", "lerp", "lerp_"):
        assert unfused not in names, (unfused, names)


def _centred_run(params, nonfinite, state=None, steps=2, seed=12, nesterov=False):
    group = {"params": params, "rule": "row", "center": True, "nesterov": nesterov, "nonfinite": nonfinite}
    opt = EquivariantOptimizer([group], lr=0.01, beta=0.9)
    if state is not None:
        opt.load_state_dict(state)
        opt.param_groups[0]["nonfinite"] = nonfinite  # (the loaded group's setting otherwise)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) + torch.linspace(-2.0, 2.0, p.shape[-1])  # column means
        opt.step()
    return opt


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "ema"])
def test_a_centred_part_keeps_its_momentum_in_the_quotient(nesterov):
    """A centred row-norm part lets each gradient into its momentum centred (column sums
    taken with the flags, subtracted as the momentum stage reads the gradient): its
    momentum stays centred though the gradients are not, and a momentum adopted uncentred
    (loaded from a run without ``center``) is centred first, so the steps equal the
    per-parameter path's, which centres in place every step."""
    g = torch.Generator().manual_seed(3)
    start = [torch.randn(40, 16, generator=g) for _ in range(3)]
    uncentred = _centred_run([torch.nn.Parameter(t.clone()) for t in start], "skip").state_dict()
    for entry in uncentred["state"].values():
        entry["momentum_buffer"] += torch.linspace(0.5, 1.5, 16)  # columns far from centred
    found = []
    for nonfinite in ("skip", "raise"):  # the bucket's fused path, the per-parameter path
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = _centred_run(params, nonfinite, state=uncentred, nesterov=nesterov)
        assert bool(opt._buckets is not None and opt._buckets.covered) == (nonfinite == "skip")
        found.append((params, opt))
    (bucketed, opt), (single, ref) = found
    for a, b in zip(bucketed, single):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
        momentum = opt.state[a]["momentum_buffer"]
        assert momentum.mean(dim=0).abs().max() < 1e-6 * momentum.abs().max()


def test_adopting_a_centred_momentum_changes_no_bit():
    """Resuming a centred part from its own state dict: the momentum it adopts is centred
    already, so the step after the load is bit for bit the uninterrupted run's."""
    g = torch.Generator().manual_seed(4)
    start = [torch.randn(40, 16, generator=g) for _ in range(2)]
    straight = [torch.nn.Parameter(t.clone()) for t in start]
    _centred_run(straight, "skip", steps=3)
    resumed = [torch.nn.Parameter(t.clone()) for t in start]
    saved = _centred_run(resumed, "skip", steps=2).state_dict()
    group = {"params": resumed, "rule": "row", "center": True, "nesterov": False, "nonfinite": "skip"}
    opt = EquivariantOptimizer([group], lr=0.01, beta=0.9)
    opt.load_state_dict(saved)
    gen = torch.Generator().manual_seed(12)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) + torch.linspace(-2.0, 2.0, p.shape[-1]) for p in resumed]
    for p, grad in zip(resumed, grads):
        p.grad = grad
    opt.step()
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("settings", PART_RULES[:2], ids=["nesterov", "ema"])
def test_a_step_holds_no_more_than_its_map_does(settings):
    """The map's input (the parts' work matrices side by side) and each part's update are
    written over the bucket's spent gradients: the step's peak is the map's own."""
    from equiopt.optim.rules import factored_map
    from equiopt.peakmem import peak_extra_bytes

    params, opt = _run_parts(settings, "skip", steps=1, copies=64)  # large enough to see
    (bucket,) = opt._buckets.matrix
    size = 4 * sum(p.numel() for p in params)
    x = torch.randn(size // 4 // (24 * 8), 24, 8)
    alone = peak_extra_bytes(lambda: factored_map(bucket.key, bucket.eta, x))
    step = peak_extra_bytes(opt.step)
    assert alone > size  # the map forms new matrices of the bucket's size
    assert step <= alone + size // 8, (step / size, alone / size)


@pytest.mark.parametrize(
    "settings,shapes",
    CASES[:1] + CASES[3:4] + CASES[10:11] + CASES[12:13],
    ids=["spectral", "row", "adamw", "normuon"],
)
def test_a_member_without_a_gradient_stays_put_while_the_others_step(settings, shapes):
    bucketed, opt = _run(settings, shapes, "skip", steps=3)
    before = [p.detach().clone() for p in bucketed]
    state = {k: v.clone() for k, v in opt.state[bucketed[1]].items()}
    g = torch.Generator().manual_seed(5)
    for p in bucketed:
        p.grad = torch.randn(p.shape, generator=g)
    bucketed[1].grad = None
    opt.step()
    assert torch.equal(bucketed[1].detach(), before[1])
    for key, value in state.items():
        assert torch.equal(opt.state[bucketed[1]][key], value), key
    assert not torch.equal(bucketed[0].detach(), before[0])
    assert opt.nonfinite_steps == 0 and opt.last_nonfinite == []


def test_bfloat16_parameters_step_as_the_per_parameter_path():
    settings, shapes = {"rule": "spectral", "layout": "heads:4"}, [(16, 8), (16, 8)]
    a, _ = _run(settings, shapes, "skip", dtype=torch.bfloat16)
    b, _ = _run(settings, shapes, "raise", dtype=torch.bfloat16)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.float(), y.float(), rtol=1e-2, atol=1e-2)


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_state_entries_are_views_of_stacks_made_once():
    params = _params([(16, 8)] * 3 + [(8,)] * 2)
    opt = EquivariantOptimizer(
        [{"params": params[:3], "rule": "spectral", "layout": "heads:4"}, {"params": params[3:], "rule": "adamw"}]
    )
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    ptrs = {(id(p), k): v.data_ptr() for p in params for k, v in opt.state[p].items()}
    stores = {_storage(opt.state[p]["momentum_buffer"]) for p in params[:3]}
    assert len(stores) == 1  # one stacked tensor holds the three momenta
    scratch = [t.data_ptr() for t in opt._buckets.scratch.values()]
    for _ in range(3):
        opt.step()
    assert {(id(p), k): v.data_ptr() for p in params for k, v in opt.state[p].items()} == ptrs
    assert [t.data_ptr() for t in opt._buckets.scratch.values()] == scratch


def test_a_replaced_state_entry_or_a_loaded_state_dict_is_stacked_again():
    params = _params([(16, 8)] * 2)
    opt = EquivariantOptimizer([{"params": params, "rule": "spectral", "layout": "heads:4"}], lr=0.01)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    opt.state[params[0]]["momentum_buffer"] = torch.full((16, 8), 0.5)  # by hand
    opt.step()
    stores = {_storage(opt.state[p]["momentum_buffer"]) for p in params}
    assert len(stores) == 1
    saved = copy.deepcopy(opt.state_dict())
    twin = EquivariantOptimizer([{"params": [copy.deepcopy(p) for p in params], "rule": "spectral"}])
    twin_params = twin.param_groups[0]["params"]
    twin.load_state_dict(saved)
    for p, q in zip(params, twin_params):
        q.grad = p.grad.clone()
    opt.step()
    twin.step()
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)


def test_the_step_never_writes_a_gradient():
    params = _params([(16, 8)] * 2 + [(8,)])
    opt = EquivariantOptimizer(
        [{"params": params[:2], "rule": "hybrid"}, {"params": params[2:], "rule": "adamw"}], lr=0.01
    )
    for p in params:
        p.grad = torch.randn(p.shape)
    params[0].grad[1, 1] = float("nan")
    versions = [p.grad._version for p in params]
    kept = [p.grad.clone() for p in params]
    opt.step()
    assert [p.grad._version for p in params] == versions
    for p, g in zip(params, kept):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
    assert opt.last_nonfinite == ["param_groups[0].params[0]"]


def test_graphed_step_needs_cuda_parameters():
    params = _params([(16, 8)])
    opt = EquivariantOptimizer(params)
    with pytest.raises(ValueError, match="CUDA"):
        GraphedStep(opt)


@pytest.mark.parametrize("recipe", ["paper:qwen3:a-i", "paper:qwen3:b-ii", "equiopt:default"])
def test_operators_per_step_stay_few_and_flat_in_depth(recipe):
    """The eager step on Qwen3-0.6B's structure (310 parameters) dispatches at most 600
    operators, and 56 layers need less than 10 % more than 28 (`python -m equiopt.bench --ops`)."""
    pytest.importorskip("transformers")
    from equiopt.opcount import ops_per_step
    from equiopt.roles import build_optimizer

    counts = {n: ops_per_step(lambda m: build_optimizer(m, recipe, compile=False)[0], n).total for n in (28, 56)}
    assert counts[28] <= 600, counts
    assert counts[56] < 1.1 * counts[28], counts


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["paper:qwen3:a-i", "paper:qwen3:b-ii"])
def test_compiled_cores_compile_once_per_kind_and_equal_eager(recipe):
    """``compile=``: one graph per kind of bucket (no graph break: fullgraph), none more over
    10 steps under a schedule, and the same weights as eager steps (float32 polar)."""
    pytest.importorskip("transformers")
    from torch._dynamo.testing import CompileCounterWithBackend

    from equiopt.opcount import qwen3_structure
    from equiopt.roles import build_optimizer

    def train(compile_setting):
        model = qwen3_structure(3, 32)
        opt, _ = build_optimizer(model, recipe, compile=compile_setting, overrides={"*": {"polar_dtype": "float32"}})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
        g = torch.Generator().manual_seed(3)
        graphs = []
        for _ in range(10):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            sched.step()
            graphs.append(counter.frame_count)
        return list(model.parameters()), opt, graphs

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    compiled, opt, graphs = train(counter)
    kinds = len(opt._buckets.matrix) + len(opt._buckets.adamw)
    # the backend may be asked again while Dynamo restarts one trace (a float input made a
    # tensor); no graph is added after the first step
    assert counters["stats"]["unique_graphs"] == kinds and not opt._compile_failed
    assert graphs == [graphs[0]] * 10
    eager, _, _ = train(False)
    for a, b in zip(compiled, eager):
        assert ((a - b).norm() / b.norm()).item() <= 1e-5


@pytest.mark.parametrize("change", [{"beta": 0.5, "weight_decay": 0.2}, {"method": "newton_schulz"}, {"lazy": True}])
def test_settings_changed_between_steps_apply_as_on_the_per_parameter_path(change):
    """A schedule of momentum or decay, or a map setting changed by hand, takes effect at the
    next step, as it does one parameter at a time."""
    results = []
    for nonfinite in ("skip", "raise"):
        params = _params([(16, 8)] * 3)
        opt = EquivariantOptimizer(
            [{"params": params, "rule": "spectral", "layout": "heads:4", "nonfinite": nonfinite}],
            lr=0.02,
            polar_dtype=torch.float32,
        )
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 2:
                opt.param_groups[0].update(change)
            opt.step()
        results.append(params)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
