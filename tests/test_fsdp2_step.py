"""The optimizer step on FSDP2 (row-sharded DTensor) parameters, on 2 and 3 gloo processes.

Every paper recipe of every family steps a ``fully_shard``-ed tiny model (3 ranks give
uneven last shards) and must equal the single-process step on the same global
gradient; the collectives of a step are recorded and checked against the plan: what
each map sends (row-norm nothing, centred row-norm d-vectors, right/hybrid one d x d
Gram per matrix, Muon two all-to-alls with each matrix mapped on one owner rank) and
that no vocabulary-sized tensor ever crosses ranks.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from map_work import check_work_divided, counting_map_work
from sharded_steps import give_grads, global_grads, in_quotient, rel

from equiopt.optim.sharded import WAVES

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

FAMILIES = ("qwen3", "gemma3", "olmoe", "gpt_oss")
EXACT = {"*": {"method": "exact"}}
STEPS = 2


def _pair(family, recipe, world, overrides, **model_kw):
    import equiopt
    from equiopt.models import build
    from equiopt.train.parallel import apply_fsdp2

    ref = build(family, "tiny", seed=0, **model_kw)
    sharded = apply_fsdp2(copy.deepcopy(ref), torch.device("cpu"), world)
    opt_ref, _ = equiopt.build_optimizer(ref, recipe, overrides=overrides)
    opt, _ = equiopt.build_optimizer(sharded, recipe, overrides=overrides)
    return ref, sharded, opt_ref, opt


def _check_equal_steps(world):
    from torch.distributed.tensor import DTensor

    from equiopt.recipes import list_recipes

    cases = [(f, r, EXACT) for f in FAMILIES for r in list_recipes() if r.startswith(f"paper:{f}:")]
    if world > 2:  # uneven last shards: one recipe per family, every layout and plan among them
        cases = [
            (f, r, EXACT)
            for f, r in (
                ("qwen3", "paper:qwen3:b-ii"),
                ("gemma3", "paper:gemma3:a-iii"),
                ("olmoe", "paper:olmoe:ii"),
                ("gpt_oss", "paper:gpt_oss:router-hybrid"),
            )
        ]
    # the recipes' own solvers (Polar Express in float32 on the reduced Gram) on the reduce path
    cases += [
        ("qwen3", "paper:qwen3:b-ii", {"*": {"polar_dtype": "float32"}}),
        ("olmoe", "paper:olmoe:iii", {"*": {"polar_dtype": "float32"}}),
    ]
    for family, recipe, overrides in cases:
        ref, sharded, opt_ref, opt = _pair(family, recipe, world, overrides)
        for step in range(STEPS):
            give_grads(global_grads(ref, step, seed=1000), ref, sharded)
            opt_ref.step()
            opt.step()
        want = dict(ref.named_parameters())
        for name, p in sharded.named_parameters():
            assert isinstance(p, DTensor), name
            got = p.full_tensor()
            err = rel(got, want[name].detach())
            assert err <= 1e-5, f"{recipe} {overrides} world {world}: {name} differs by {err:.2e}"
            # optimizer state stays a DTensor like its parameter (DCP saves and reshards it)
            for key, value in opt.state[p].items():
                if value.ndim:
                    assert isinstance(value, DTensor) and value.placements == p.placements, (name, key)
                    mine, theirs = value.full_tensor(), opt_ref.state[want[name]][key]
                    if key == "momentum_buffer":
                        mine, theirs = in_quotient(mine, opt_ref, want[name]), in_quotient(theirs, opt_ref, want[name])
                    assert rel(mine, theirs) <= 1e-5, (recipe, name, key)


def _check_communication(world):
    from equiopt.distributed import record_collectives

    vocab, d = 16384, 64
    vocab_bytes = vocab * d * 4
    totals = {}
    for recipe in ("paper:qwen3:a-i", "paper:qwen3:b-ii"):
        ref, sharded, opt_ref, opt = _pair("qwen3", recipe, world, EXACT, vocab_size=vocab, hidden_size=d)
        give_grads(global_grads(ref, 0, seed=1000), sharded)
        with record_collectives() as log:
            opt.step()
        assert all(r.bytes < vocab_bytes / world for r in log), [
            (r.op, r.shape) for r in log if r.bytes >= vocab_bytes / world
        ]
        totals[recipe] = log.total_bytes()
        assert log.total_bytes() < vocab_bytes / 4, (recipe, log.summary())
    # per map, on one row-sharded vocabulary-shaped matrix: exactly what is planned
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from equiopt.optim import EquivariantOptimizer

    mesh = init_device_mesh("cpu", (world,))
    m = 1001  # uneven over 2 and 3 ranks
    base = torch.randn(m, d, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(m, d, generator=torch.Generator().manual_seed(4))
    planned = {  # rule, center -> (op, shape) in order
        ("row", False): [],
        ("row", True): [(d,), (d,)],  # the column means, then the centred shift
        ("right", False): [(d, d)],
        ("right", True): [(d,), (d, d), (d,)],
        ("hybrid", False): [(d, d)],
        ("hybrid", True): [(d,), (d,), (d, d), (d,)],
    }
    for (rule, center), shapes in planned.items():
        w = torch.nn.Parameter(distribute_tensor(base.clone(), mesh, [Shard(0)]))
        w.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        opt = EquivariantOptimizer(
            [{"params": [w], "names": ["lm_head.weight"]}], lr=0.1, rule=rule, center=center, method="exact"
        )
        with record_collectives() as log:
            opt.step()
        assert [r.op for r in log] == ["all_reduce"] * (len(shapes) + 1), (rule, center, log.summary())
        # the first is the finite flag of the parameter (one float per parameter of the group)
        assert [tuple(r.shape[-len(s) :]) if s else () for r, s in zip(log.records[1:], shapes)] == shapes, (
            rule,
            center,
            [r.shape for r in log],
        )
        assert log.records[0].bytes == 4
        ref = torch.nn.Parameter(base.clone())
        ref.grad = grad.clone()
        EquivariantOptimizer([ref], lr=0.1, rule=rule, center=center, method="exact").step()
        assert rel(w.full_tensor(), ref.detach()) <= 1e-5, (rule, center)
    # the scale-transferable size (its soft row count is a sum over rows too), every hybrid order
    for rule, order, center in (
        ("right", "row_then_right", True),
        ("hybrid", "row_then_right", True),
        ("hybrid", "right_then_row", False),
        ("hybrid", "right_then_row", True),
    ):
        kw = dict(lr=0.1, rule=rule, order=order, center=center, method="exact", scale="rms")
        w = torch.nn.Parameter(distribute_tensor(base.clone(), mesh, [Shard(0)]))
        w.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        EquivariantOptimizer([w], **kw).step()
        ref = torch.nn.Parameter(base.clone())
        ref.grad = grad.clone()
        EquivariantOptimizer([ref], **kw).step()
        assert rel(w.full_tensor(), ref.detach()) <= 1e-5, (rule, order, center)
    # lazy rows (an embedding's sparse gradient): masked on each shard, on the reduce path
    # (hybrid, right Gram) and on the owner path (spectral: the rows sent are masked)
    sparse = grad * (torch.rand(m, generator=torch.Generator().manual_seed(5)) < 0.3)[:, None]
    for kw in (dict(rule="hybrid", scale="rms", method="exact"), dict(rule="spectral", polar_dtype=torch.float32)):
        w = torch.nn.Parameter(distribute_tensor(base.clone(), mesh, [Shard(0)]))
        w.grad = distribute_tensor(sparse.clone(), mesh, [Shard(0)])
        EquivariantOptimizer([w], lr=0.1, lazy=True, **kw).step()
        ref = torch.nn.Parameter(base.clone())
        ref.grad = sparse.clone()
        EquivariantOptimizer([ref], lr=0.1, lazy=True, **kw).step()
        got = w.full_tensor()
        assert rel(got, ref.detach()) <= 1e-5, kw
        unseen = sparse.abs().sum(dim=1) == 0
        assert torch.equal(got[unseen], base[unseen]), kw
    # a layout whose work rows are cut by the shards: the local gradient cannot tell, say so
    w = torch.nn.Parameter(distribute_tensor(base.clone(), mesh, [Shard(0)]))
    w.grad = distribute_tensor(sparse.clone(), mesh, [Shard(0)])
    opt = EquivariantOptimizer([{"params": [w], "names": ["emb.weight"]}], lr=0.1, rule="row", layout="col", lazy=True)
    with pytest.raises(ValueError, match="'emb.weight': lazy=True needs whole work rows on every rank"):
        opt.step()
    return totals


def _check_owner_based(world):
    """Muon on unevenly row-sharded matrices (the per-parameter exchange; even ones share
    their bucket's, :func:`_check_owner_buckets`): each is mapped whole on one owner rank (the work split
    among the ranks), with exactly two all-to-alls (rows to owners, update rows back)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from equiopt.distributed import record_collectives
    from equiopt.optim import EquivariantOptimizer
    from equiopt.optim.owners import map_cost

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(7)
    shapes = [(49, 24)] * 4 + [(31, 64), (65, 31), (7, 5)]  # uneven over 2 and 3 ranks, tiny shards included
    bases = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    params = [torch.nn.Parameter(distribute_tensor(b.clone(), mesh, [Shard(0)])) for b in bases]
    for p, g in zip(params, grads):
        p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
    kw = dict(lr=0.05, rule="spectral", polar_dtype=torch.float32)
    opt = EquivariantOptimizer(params, **kw)
    with counting_map_work() as done, record_collectives() as log:
        opt.step()
    waves = min(WAVES, len(shapes))
    # one all-to-all each way per wave, the next wave's blocks sent before this wave's updates return
    order = ["send0"] + [x for k in range(waves) for x in ([f"send{k + 1}"] if k + 1 < waves else []) + [f"return{k}"]]
    assert log.ops() == ["all_reduce"] + ["all_to_all"] * (2 * waves), log.summary()
    # what this rank sends to the owners: its rows of every matrix, each once
    sent = sum(r.bytes for r, what in zip(log.records[1:], order) if what.startswith("send"))
    assert sent == sum(p.to_local().numel() * 4 for p in params)
    loads = check_work_divided(done, [map_cost(s) for s in shapes])
    assert int((loads > 0).sum()) == min(world, len(shapes)), loads
    for p, b, g in zip(params, bases, grads):
        ref = torch.nn.Parameter(b.clone())
        ref.grad = g.clone()
        EquivariantOptimizer([ref], **kw).step()
        assert rel(p.full_tensor(), ref.detach()) <= 1e-5


def _check_owner_buckets(world):
    """Muon on evenly sharded matrices of one work shape, some stored as it (layout ``row``,
    the split cutting work rows), some transposed (``col``, cutting work columns): one bucket
    of their blocks (:mod:`equiopt.optim.sharded_buckets`), its parts' flags agreed in one
    all-reduce, each matrix mapped whole on one owner rank in one all-to-all each way; the
    bytes are the planned ones, the work is divided, a NaN in one rank's block skips that
    matrix on every rank, and the state stays DTensors that are views of the bucket's stacks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from equiopt.distributed import record_collectives
    from equiopt.optim import EquivariantOptimizer
    from equiopt.optim.owners import map_cost
    from equiopt.optim.planner import plan_step

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(8)
    work = (6 * world, 4 * world)  # every block has 24 * world entries, cut along rows or columns
    layouts = ["row"] * 3 + ["col"] * 2
    shapes = [work if lay == "row" else work[::-1] for lay in layouts]
    count = len(shapes)
    bases = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]
    grads[1][2][shapes[2][0] - 1, 3] = float("nan")  # in the last rank's block only
    grads[1][4][shapes[4][0] - 1, 1] = float("inf")  # a transposed one's, the same
    params = [torch.nn.Parameter(distribute_tensor(b.clone(), mesh, [Shard(0)])) for b in bases]
    refs = [torch.nn.Parameter(b.clone()) for b in bases]
    kw = dict(lr=0.05, rule="spectral", polar_dtype=torch.float32, weight_decay=0.1)

    def groups(ps):
        return [{"params": ps[:3], "layout": "row"}, {"params": ps[3:], "layout": "col"}]

    opt, opt_ref = EquivariantOptimizer(groups(params), **kw), EquivariantOptimizer(groups(refs), **kw)
    for step in range(STEPS):
        for p, r, g in zip(params, refs, grads[step]):
            p.grad, r.grad = distribute_tensor(g.clone(), mesh, [Shard(0)]), g.clone()
        before = [p.full_tensor() for p in params]
        with counting_map_work() as done, record_collectives() as log:
            opt.step()
        opt_ref.step()
        # one all-reduce of the bucket's flags (both parts, one process group), two all-to-alls
        assert log.ops() == ["all_reduce", "all_to_all", "all_to_all"], log.summary()
        assert log.records[0].bytes == 4 * count  # one flag per member
        block = params[0].to_local().numel()
        assert params[3].to_local().numel() == block
        assert log.records[1].bytes == count * block * 4  # every block out, once
        planned = plan_step(opt, [dist.get_rank()])
        assert log.total_bytes() == planned.per_rank[dist.get_rank()][0]
        # the plan names the bucket that steps each matrix (the one the step runs)
        assert [p.step for p in planned.parameters] == ["bucket 0"] * count
        check_work_divided(done, [map_cost(work)] * count)
        for k, (p, r) in enumerate(zip(params, refs)):
            assert rel(p.full_tensor(), r.detach()) <= 1e-5, (step, k)
            if step == 1 and k in (2, 4):  # skipped on every rank: untouched, counted once per rank
                assert torch.equal(p.full_tensor(), before[k])
                assert opt.state[p]["nonfinite"].item() == 1
    (bucket,) = opt._buckets.matrix
    assert bucket.map_fn is not None and [len(part.params) for part in bucket.parts] == [3, 2]
    names = [n for g in opt.param_groups for n in g["names"]]
    assert opt.last_nonfinite == [names[2], names[4]] and opt.nonfinite_steps == 2
    for k, (p, r) in enumerate(zip(params, refs)):
        m = opt.state[p]["momentum_buffer"]
        assert isinstance(m, DTensor) and m.placements == p.placements
        stack = bucket.parts[k // 3].stacks["momentum_buffer"]
        assert m.to_local().untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
        assert rel(m.full_tensor(), opt_ref.state[r]["momentum_buffer"]) <= 1e-5


def _check_gram_polar(world):
    """Muon with the Gram Newton-Schulz polar factor on row-sharded tall matrices runs on
    the shards: one ``c x c`` all-reduce of the Gram, one more per restart, nothing else;
    a wide matrix (its Gram would be over the split rows) still goes to an owner. Both
    equal one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from equiopt.distributed import record_collectives
    from equiopt.linalg.polar import RESTART_EVERY
    from equiopt.optim import EquivariantOptimizer

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(11)
    kw = dict(lr=0.05, rule="spectral", method="gram_newton_schulz", steps=5, cost_model="reduce")
    for shape, plan in (((301, 24), "reduce"), ((24, 301), "owner")):
        base, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        w = torch.nn.Parameter(distribute_tensor(base.clone(), mesh, [Shard(0)]))
        w.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        opt = EquivariantOptimizer([w], **kw)
        assert opt.plan_of(opt.param_groups[0], opt.param_groups[0]["layouts"][0], opt._sharding(w)).how == plan
        with record_collectives() as log:
            opt.step()
        if plan == "reduce":
            grams = 1 + (kw["steps"] - 1) // RESTART_EVERY
            assert log.ops() == ["all_reduce"] * (1 + grams), log.summary()
            assert [tuple(r.shape) for r in log.records[1:]] == [(shape[1], shape[1])] * grams
        else:
            assert "all_to_all" in log.ops(), log.summary()
        ref = torch.nn.Parameter(base.clone())
        ref.grad = grad.clone()
        EquivariantOptimizer([ref], **{k: v for k, v in kw.items() if k != "cost_model"}).step()
        assert rel(w.full_tensor(), ref.detach()) <= 1e-5, (shape, rel(w.full_tensor(), ref.detach()))


def _worker(rank, world):
    _check_gram_polar(world)
    _check_owner_based(world)
    _check_owner_buckets(world)
    _check_equal_steps(world)
    return _check_communication(world) if world == 2 else None


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_step_equals_one_process_and_sends_what_is_planned(world, gloo):
    totals = gloo(_worker, world)[0]
    if world == 2:
        assert set(totals) == {"paper:qwen3:a-i", "paper:qwen3:b-ii"}
        assert all(b < 16384 * 64 * 4 / 4 for b in totals.values()), totals
        print("bytes per step:", totals)


def _count_ops(rank, world):
    from equiopt.opcount import ops_per_step, placed_step_ops
    from equiopt.roles import build_optimizer

    counts = {}
    for recipe, placement in SHARDED_OPS:
        for layers in (4, 8):
            found = placed_step_ops(recipe, layers, placement)
            counts[(recipe, placement, layers)] = (found.total, found.launches)
    for recipe in DIVIDED_OPS:  # one process, for the divided step's bound
        found = ops_per_step(lambda m, r=recipe: build_optimizer(m, r, compile=False)[0], 8)
        counts[(recipe, "one", 8)] = (found.total, found.launches)
        found = placed_step_ops(recipe, 8, "ddp")
        counts[(recipe, "ddp", 8)] = (found.total, found.launches)
    found = placed_step_ops("paper:qwen3:b-ii", 8, "fsdp2")
    counts[("paper:qwen3:b-ii", "fsdp2", 8)] = (found.total, found.launches)
    return counts


def _count_hsdp(rank, world):
    from equiopt.opcount import ops_per_step, placed_step_ops
    from equiopt.roles import build_optimizer

    counts = {}
    for recipe in ("paper:qwen3:a-i", "paper:qwen3:b-ii"):
        counts[(recipe, "hsdp")] = placed_step_ops(recipe, 8, "hsdp").total
        counts[(recipe, "one")] = ops_per_step(lambda m, r=recipe: build_optimizer(m, r, compile=False)[0], 8).total
    return counts


SHARDED_OPS = (("paper:qwen3:a-i", "fsdp2"), ("normuon", "fsdp2"), ("paper:qwen3:a-i", "ddp"))
DIVIDED_OPS = ("paper:qwen3:a-i", "paper:qwen3:b-ii", "normuon")


@pytest.mark.slow
def test_a_sharded_step_dispatches_a_few_operators_per_parameter(gloo):
    """The Qwen3-0.6B structure (11 parameters a layer) under FSDP2 on 2 ranks (and under DDP
    with divided maps, bucketed as on one process): each stage of
    the sharded parameters' step is one foreach operator or one batched call per group or
    shape, and the owner exchange moves alike matrices as one stack, so four more layers (44
    parameters) add at most a few views a parameter (none for a-i, whose evenly sharded
    matrices are bucketed); NorMuon's row stage still runs per block. One by one the stages cost about 45 operators a parameter,
    25 of them kernels: flags, sanitising, momentum, decay, guard and add per parameter."""
    counts = gloo(_count_ops, 2)[0]
    # per parameter: operators, kernels
    bounds = {
        ("paper:qwen3:a-i", "fsdp2"): (4, 0.25),
        ("normuon", "fsdp2"): (8, 2),
        ("paper:qwen3:a-i", "ddp"): (4, 0.5),
    }
    for case in SHARDED_OPS:
        grown = [b - a for a, b in zip(counts[(*case, 4)], counts[(*case, 8)])]
        ops, kernels = bounds[case]
        assert grown[0] <= ops * 44 and grown[1] <= kernels * 44, (case, counts)
    # DDP with divided maps steps the buckets of one process, and FSDP2 steps a-i's evenly
    # sharded matrices in buckets too (equiopt.optim.sharded_buckets): four more layers add
    # no operator to either (each bucket's share and all-gather, or exchange)
    for placement in ("ddp", "fsdp2"):
        assert counts[("paper:qwen3:a-i", placement, 8)] == counts[("paper:qwen3:a-i", placement, 4)], counts
    for recipe in DIVIDED_OPS:
        one, ddp = counts[(recipe, "one", 8)], counts[(recipe, "ddp", 8)]
        assert ddp[0] <= 1.1 * one[0] and ddp[1] <= 1.1 * one[1], (recipe, one, ddp)
    # FSDP2 steps at most half again one process's operators: the hidden matrices' blocks in
    # buckets, one exchange for the MLP's row-cut and column-cut blocks
    for recipe in ("paper:qwen3:a-i", "paper:qwen3:b-ii"):
        one, fsdp2 = counts[(recipe, "one", 8)], counts[(recipe, "fsdp2", 8)]
        assert fsdp2[0] <= 1.5 * one[0], (recipe, one, fsdp2)


@pytest.mark.slow
def test_hsdp_step_dispatches_at_most_half_again_one_process(gloo):
    """HSDP (2 replicas of 2-rank shards): the replicas divide the owner work of the
    buckets (equiopt.optim.sharded_buckets), so rank 0 steps the Qwen3-0.6B structure in
    at most 1.5 times one process's operators."""
    counts = gloo(_count_hsdp, 4)[0]
    for recipe in ("paper:qwen3:a-i", "paper:qwen3:b-ii"):
        assert counts[(recipe, "hsdp")] <= 1.5 * counts[(recipe, "one")], (recipe, counts)


def test_unsupported_placements_fail_at_construction(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from equiopt.distributed import UnsupportedShardingError
    from equiopt.optim import EquivariantOptimizer

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 6), mesh, [Partial()]))
        with pytest.raises(UnsupportedShardingError, match=r"'mlp\.down_proj\.weight'.*Partial"):
            EquivariantOptimizer([{"params": [w], "names": ["mlp.down_proj.weight"]}], rule="row")
    finally:
        dist.destroy_process_group()
