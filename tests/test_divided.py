"""Optimizer work divided among DDP replicas (``divide_work``), on 2 and 3 gloo processes.

Every rank holds the same parameters and gradients (as after DDP's all-reduce). With
``divide_work`` a bucket of matrices that share a map is divided by matrices, each
replica mapping its share and the factors all-gathered; of the rest, the Gram maps
(right-spectral, hybrid) sum one slice of the rows per replica and all-reduce the
``d x d`` sums, and every other matrix-product map runs on one owner rank and is broadcast. The weights must be bit-identical on every rank, equal the
undivided step, each rank must do only its share, and what crosses ranks is exactly the
Grams and the broadcast updates.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from map_work import check_work_divided, counting_map_work

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

EXACT = {"*": {"method": "exact"}}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _grads(model, step):
    gen = torch.Generator().manual_seed(2000 + step)
    return {name: torch.randn(p.shape, generator=gen, dtype=p.dtype) for name, p in model.named_parameters()}


def _identical_on_every_rank(t: torch.Tensor) -> bool:
    flat = t.detach().reshape(-1).contiguous()
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return all(torch.equal(o, flat) for o in out)


def _check_recipes(world):
    import equiopt
    from equiopt.models import build
    from equiopt.optim.owners import map_cost

    cases = [
        ("qwen3", "paper:qwen3:a-i"),
        ("qwen3", "paper:qwen3:b-ii"),
        ("qwen3", "paper:qwen3:b-iii"),
        ("gemma3", "paper:gemma3:a-iii"),
        ("olmoe", "paper:olmoe:ii"),
        ("gpt_oss", "paper:gpt_oss:router-hybrid"),
        ("olmoe", "normuon"),  # the polar factors divided, every replica's row stage on its own state
    ]
    for family, recipe in cases:
        ref = build(family, "tiny", seed=0)
        model = copy.deepcopy(ref)
        opt_ref, _ = equiopt.build_optimizer(ref, recipe, overrides=EXACT)
        opt, _ = equiopt.build_optimizer(model, recipe, overrides=EXACT, divide_work=True)
        for step in range(2):
            grads = _grads(ref, step)
            for m in (ref, model):
                for name, p in m.named_parameters():
                    p.grad = grads[name].clone()
            opt_ref.step()
            with counting_map_work() as done:
                opt.step()
            if recipe == "normuon":  # each polar factor mapped once, on one replica
                matrices = [
                    w
                    for g in opt.param_groups
                    if g["rule"] == "normuon"
                    for q, layout in zip(g["params"], g["layouts"])
                    for w in layout.work_shapes(q.shape)
                ]
                check_work_divided(done, [map_cost(m) for w in matrices for m in _matrices(w)])
        want = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert _identical_on_every_rank(p), f"{recipe} world {world}: {name} differs across ranks"
            err = _rel(p.detach(), want[name].detach())
            assert err <= 1e-5, f"{recipe} world {world}: {name} differs from the undivided step by {err:.2e}"
            for key, value in opt.state[p].items():  # momentum, NorMuon's row moments: the same on every rank
                if torch.is_tensor(value) and value.ndim:
                    assert _identical_on_every_rank(value), (recipe, name, key)
                    assert _rel(value, opt_ref.state[want[name]][key]) <= 1e-5, (recipe, name, key)


def _matrices(shape):
    """The matrices of a ``(..., m, n)`` batch of work matrices, as shapes."""
    return [tuple(shape[-2:])] * int(torch.Size(shape[:-2]).numel())


def _check_division(world):
    """Muon on several same-shaped matrices: each rank maps only its share. A bucket of at
    least one matrix per rank is divided by matrices, its factors all-gathered (one
    all-gather per bucket, padded to equal shares); every other matrix is mapped by one
    owner, one broadcast per owner and wave carrying exactly the updates it owns."""
    from collections import Counter

    from equiopt.distributed import record_collectives
    from equiopt.optim import EquivariantOptimizer
    from equiopt.optim.owners import assign
    from equiopt.optim.sharded import WAVES

    gen = torch.Generator().manual_seed(5)
    shapes = [(48, 32)] * 5 + [(32, 96)] * 2 + [(200, 16)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    vec = torch.nn.Parameter(torch.randn(32, generator=gen))
    for p in params + [vec]:
        p.grad = torch.randn(p.shape, generator=gen)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    waited = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, q, p in zip(ref, waited, params):
        r.grad, q.grad = p.grad.clone(), p.grad.clone()
    groups = [{"params": params, "rule": "spectral", "polar_dtype": torch.float32}, {"params": [vec], "rule": "adamw"}]
    opt = EquivariantOptimizer(groups, lr=0.05, divide_work=True)
    # every broadcast waited for at once: the overlapped step must equal it bit for bit
    EquivariantOptimizer(
        [{"params": waited, "rule": "spectral", "polar_dtype": torch.float32}], lr=0.05, divide_work=True, overlap=False
    ).step()
    with counting_map_work() as done, record_collectives() as log:
        opt.step()
    EquivariantOptimizer([{"params": ref, "rule": "spectral", "polar_dtype": torch.float32}], lr=0.05).step()
    costs = [s[0] * s[1] * min(s) for s in shapes]
    assert 0 < sum(done) < sum(costs), (done, costs)
    check_work_divided(done, costs)
    counts = Counter(shapes)
    gathers = [r for r in log if r.op == "all_gather"]
    divided = {s: c for s, c in counts.items() if c >= world}
    assert sorted(r.bytes for r in gathers) == sorted(
        -(-c // world) * world * s[0] * s[1] * 4 for s, c in divided.items()
    )
    owned = [s for s in shapes if counts[s] < world]
    broadcasts = [r for r in log if r.op == "broadcast"]
    # one broadcast per owner and wave (waves take every WAVES-th matrix, longest first)
    owned_costs = [s[0] * s[1] * min(s) for s in owned]
    order = sorted(range(len(owned)), key=lambda t: (-owned_costs[t], t))
    owners = assign(owned_costs, world)
    expected = sum(len({owners[t] for t in order[w::WAVES]}) for w in range(min(WAVES, len(owned))))
    assert len(broadcasts) == expected, log.summary()
    assert all(r.op in ("broadcast", "all_reduce", "all_gather") for r in log), log.summary()
    assert sum(r.bytes for r in broadcasts) == sum(s[0] * s[1] * 4 for s in owned)
    for p, r, q in zip(params, ref, waited):
        assert _identical_on_every_rank(p)
        assert _rel(p.detach(), r.detach()) <= 1e-5
        assert torch.equal(p.detach(), q.detach())


def _check_bucket_division(world):
    """One bucket of ``world + 1`` matrices (a rank with a partial share; on 3 ranks one
    past the end, which maps nothing): each rank maps its share, and what crosses is the
    map's own output once, at its width: Muon's bfloat16 polar factor, or a Gram route's
    ``n x n`` factor (its ``x`` is the input, which every rank holds). The weights are the
    same on every rank and equal the undivided step; the buckets are made once."""
    from equiopt.distributed import record_collectives
    from equiopt.optim import EquivariantOptimizer

    count, m, d = world + 1, 40, 24
    gen = torch.Generator().manual_seed(17)
    base = [torch.randn(m, d, generator=gen) for _ in range(count)]
    grads = [torch.randn(m, d, generator=gen) for _ in range(count)]
    share = -(-count // world)
    mine = max(0, min(share, count - dist.get_rank() * share))
    cases = [
        (dict(rule="spectral"), [("all_gather", share * world * m * d * 2)]),  # the bfloat16 polar factor
        (dict(rule="right", method="exact"), [("all_gather", share * world * d * d * 4)]),  # R of x R
    ]
    for kw, sent in cases:
        params = [torch.nn.Parameter(b.clone()) for b in base]
        refs = [torch.nn.Parameter(b.clone()) for b in base]
        opt = EquivariantOptimizer(params, lr=0.1, divide_work=True, **kw)
        ref = EquivariantOptimizer(refs, lr=0.1, **kw)
        for step in range(2):
            for p, r, g in zip(params, refs, grads):
                p.grad, r.grad = g * (step + 1), g * (step + 1)
            with counting_map_work() as done, record_collectives() as log:
                opt.step()
            ref.step()
            if step == 0:
                made = opt._buckets
            assert opt._buckets is made, kw  # made once
            assert sum(done) == mine * m * d * min(m, d), (kw, done, mine)
            assert [(r.op, r.bytes) for r in log] == sent, (kw, log.summary())
        for p, r in zip(params, refs):
            assert _identical_on_every_rank(p), kw
            assert _rel(p.detach(), r.detach()) <= 1e-6, (kw, _rel(p.detach(), r.detach()))


def _check_gram_division(world):
    """A vocabulary-shaped matrix under hybrid and right-spectral maps: each replica forms
    the Gram of its slice of rows (the products it computes shrink with the world); where
    bandwidth is scarce one d x d all-reduce (and d-vectors when centred) crosses ranks and
    nothing else, where it is plentiful each replica maps its rows into its weights and
    broadcasts them: one broadcast per rank, every weight once (in place, or through a
    buffer for a transposed work view), waited or overlapped."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from equiopt.distributed import record_collectives
    from equiopt.optim import EquivariantOptimizer

    m, d = 3001, 48  # uneven slices over 2 and 3 ranks
    gen = torch.Generator().manual_seed(11)
    base, grad = torch.randn(m, d, generator=gen), torch.randn(m, d, generator=gen)
    from equiopt.optim.costs import CostModel

    # scarce bandwidth: only the Grams' sums; plentiful, and the matrix too large for an owner: rows
    slow, fast = CostModel(bandwidth=1.0, flops=1e11), CostModel(bandwidth=1e30, flops=1e11, owner_max_bytes=0)
    cases = [
        (dict(rule="hybrid"), slow),
        (dict(rule="hybrid", center=True, scale="rms"), slow),
        (dict(rule="right", center=True), slow),
        (dict(rule="hybrid", center=True), fast),
        (dict(rule="right"), fast),
        (dict(rule="right", overlap=False), fast),
        (dict(rule="hybrid", layout="col"), fast),  # work rows are the stored columns
        (dict(rule="hybrid", dtype=torch.bfloat16), fast),  # weight rows travel in bfloat16
    ]
    for kw, costs in cases:
        kw = dict(kw)
        dtype = kw.pop("dtype", torch.float32)
        stored = (base.T.contiguous() if kw.get("layout") == "col" else base).to(dtype)
        w = torch.nn.Parameter(stored.clone())
        w.grad = (grad.T.contiguous() if kw.get("layout") == "col" else grad).to(dtype)
        opt = EquivariantOptimizer([w], lr=0.1, method="exact", divide_work=True, cost_model=costs, **kw)
        products = []
        first = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1, "addmm_": 1, "baddbmm_": 1}  # the left operand's position

        class Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                at = first.get(func.overloadpacket.__name__)
                if at is not None:
                    a = args[at]
                    if a.shape[-2] == d and a.shape[-1] > d:  # x^T x: a Gram over some rows (or a block of them)
                        products.append(a.shape[-1])
                return func(*args, **(kwargs or {}))

        with record_collectives() as log, Counting():
            opt.step()
        assert products and sum(products) <= -(-m // world), (kw, products)  # this rank's rows only
        assert any(r.op == "all_reduce" and r.shape[-2:] == (d, d) for r in log), (kw, log.summary())
        if costs is slow:  # only the sums cross ranks: every replica finishes on all rows
            assert set(log.ops()) == {"all_reduce"} and log.total_bytes() < m * d * 4 / 10, (kw, log.summary())
        else:  # high bandwidth: each replica maps its rows into its weights and broadcasts them
            sent = [r for r in log if r.op != "all_reduce"]
            assert [r.op for r in sent] == ["broadcast"] * world, (kw, log.summary())
            assert sum(r.bytes for r in sent) == m * d * stored.element_size(), (kw, log.summary())
        ref = torch.nn.Parameter(stored.clone())
        ref.grad = w.grad.clone()
        EquivariantOptimizer([ref], lr=0.1, method="exact", **kw).step()
        assert _identical_on_every_rank(w), kw
        # bfloat16: the rows' float32 updates may round to neighbouring bfloat16 values
        assert _rel(w.detach().float(), ref.detach().float()) <= (1e-5 if dtype == torch.float32 else 1e-3), kw


def _check_divided_inverses(world):
    """Several same-shaped matrices under the gram division (SwiGLU-like, one bucket): the
    reduced Grams are reduce-scattered, each rank inverts only its share (padded to equal
    shares, one matrix more than the ranks divide evenly), and the factors all-gathered;
    the bytes are those of the all-reduce they replace, up to the padding."""
    import equiopt.maps.one_sided as maps_module  # the module whose maps call inv_sqrt
    from equiopt.distributed import record_collectives
    from equiopt.optim import EquivariantOptimizer
    from equiopt.optim.costs import CostModel

    count, m, d = world + 1, 40, 24
    gen = torch.Generator().manual_seed(13)
    base = [torch.randn(m, d, generator=gen) for _ in range(count)]
    grads = [torch.randn(m, d, generator=gen) for _ in range(count)]
    gram = CostModel(bandwidth=1.0, flops=1e11, prefer="reduce")  # the gram division everywhere
    for kw in (dict(rule="hybrid"), dict(rule="hybrid", center=True, scale="rms"), dict(rule="right")):
        for overlap in (True, False):
            params = [torch.nn.Parameter(b.clone()) for b in base]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt = EquivariantOptimizer(
                params, lr=0.1, method="exact", divide_work=True, cost_model=gram, overlap=overlap, **kw
            )
            inverted, original = [], maps_module.inv_sqrt

            def counting(A, *args, **kwargs):
                inverted.append(A.reshape(-1, *A.shape[-2:]).shape[0])
                return original(A, *args, **kwargs)

            maps_module.inv_sqrt = counting
            try:
                with record_collectives() as log:
                    opt.step()
            finally:
                maps_module.inv_sqrt = original
            share = -(-count // world)
            mine = max(0, min(share, count - dist.get_rank() * share))
            assert sum(inverted) == mine, (kw, inverted, mine)
            grams = [r for r in log if r.op in ("reduce_scatter", "all_gather")]
            assert [r.op for r in grams] == ["reduce_scatter", "all_gather"], (kw, log.summary())
            assert all(r.bytes == world * share * d * d * 4 for r in grams), (kw, log.summary())
            assert not any(r.op == "broadcast" for r in log), (kw, log.summary())
            refs = [torch.nn.Parameter(b.clone()) for b in base]
            for r, g in zip(refs, grads):
                r.grad = g.clone()
            EquivariantOptimizer(refs, lr=0.1, method="exact", **kw).step()
            for p, r in zip(params, refs):
                assert _identical_on_every_rank(p), kw
                assert _rel(p.detach(), r.detach()) <= 1e-5, (kw, _rel(p.detach(), r.detach()))


def _worker(rank, world):
    _check_recipes(world)
    _check_division(world)
    _check_bucket_division(world)
    _check_gram_division(world)
    _check_divided_inverses(world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_divided_step_is_identical_on_every_rank_and_equals_the_undivided_step(world, gloo):
    gloo(_worker, world)


def test_divide_work_needs_a_process_group():
    from equiopt.optim import EquivariantOptimizer

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(ValueError, match="divide_work needs an initialised torch.distributed process group"):
        EquivariantOptimizer([torch.nn.Parameter(torch.randn(4, 4))], divide_work=True)


def test_build_optimizer_divides_work_for_a_ddp_wrapped_model(tmp_path):
    from torch.nn.parallel import DistributedDataParallel

    import equiopt
    from equiopt.models import build

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = build("qwen3", "tiny", seed=0)
        opt, _ = equiopt.build_optimizer(DistributedDataParallel(model), "paper:qwen3:a-i")
        assert opt.divides_work
        assert not equiopt.build_optimizer(model, "paper:qwen3:a-i")[0].divides_work
        assert not equiopt.build_optimizer(DistributedDataParallel(model), "paper:qwen3:a-i", divide_work=False)[
            0
        ].divides_work
    finally:
        dist.destroy_process_group()
